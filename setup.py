"""Builds the wheel's kernels ahead of time (docs: Installing); the metadata is in pyproject.toml.

``pip wheel --no-build-isolation .`` compiles, against the torch installed here:
- the CPU kernel once per instruction set of ``_build.CPU_CAPABILITIES`` (x86-64; baseline only elsewhere),
  each a whole library, ``lightning_fusedsgd/ops/_lib/cpu_<capability>``;
- the CUDA kernel, ``ops/_lib/cuda``, where torch has CUDA and a CUDA toolkit is found (the one the nvcc on
  PATH belongs to, also behind a wrapper script, or ``CUDA_HOME``), for ``TORCH_CUDA_ARCH_LIST`` (default
  ``_build.DEFAULT_CUDA_ARCH_LIST``); where none is found, the wheel has the CPU kernels and one line says
  why. ``LIGHTNING_FUSEDSGD_BUILD_CUDA=0`` leaves CUDA out, ``=1`` makes a missing toolkit an error;
and records in ``ops/_lib/build.json`` the torch version and each library's path, size and SHA-256, which the
loader checks. Editable installs (``make install``) build nothing: the kernels compile on first use there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BUILD_CUDA_ENV = "LIGHTNING_FUSEDSGD_BUILD_CUDA"
PACKAGE = "lightning_fusedsgd"
CSRC = Path(PACKAGE, "ops", "csrc")
NO_DEBUG = "-g0"  # Python's own compiler flags add -g: 6 MB instead of 0.5 MB a library


def _load_build_description():
    """lightning_fusedsgd/ops/_build.py (standard library only), read before anything imports the package."""
    spec = importlib.util.spec_from_file_location(
        "_lightning_fusedsgd_build", Path(PACKAGE, "ops", "_build.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_build = _load_build_description()
# torch takes the parent of nvcc's folder as the toolkit, which is wrong where nvcc is a wrapper script: point
# it at the toolkit nvcc belongs to before torch.utils.cpp_extension reads CUDA_HOME at import.
TOOLKIT, TOOLKIT_FOUND = _build.cuda_toolkit()
if TOOLKIT is not None:
    os.environ.setdefault("CUDA_HOME", str(TOOLKIT))

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # an isolated build environment: fine for editable installs only
    torch = None


def _build_cuda() -> bool:
    switch = os.environ.get(BUILD_CUDA_ENV, "")
    if switch == "0":
        return False
    if torch.version.cuda is None:
        missing = "this torch has no CUDA"
    elif TOOLKIT is None:
        missing = f"no CUDA toolkit: {TOOLKIT_FOUND}"
    else:
        return True
    if switch == "1":
        raise SystemExit(f"{BUILD_CUDA_ENV}=1, but {missing} (set CUDA_HOME to the CUDA toolkit)")
    print(f"{PACKAGE}: building the CPU kernels only ({missing}; {BUILD_CUDA_ENV}=1 makes this an error)")
    return False


def extensions() -> list[Extension]:
    if torch is None:  # no kernel can be described without torch; BuildKernels says why where it matters
        return [Extension(f"{PACKAGE}.ops._lib.cpu_default", sources=[])]
    capabilities = list(_build.CPU_CAPABILITIES) if platform.machine() in ("x86_64", "AMD64") else ["default"]
    headers = sorted(str(path) for path in CSRC.glob("*.h"))
    cpu = _build.EXTENSIONS["cpu"]
    modules = [
        cpp_extension.CppExtension(
            f"{PACKAGE}.ops._lib.cpu_{capability}",
            sources=[str(CSRC / source) for source in cpu.sources],
            depends=headers,
            include_dirs=[str(CSRC.resolve())],
            extra_compile_args={"cxx": [*_build.cpu_flags(capability), NO_DEBUG]},
            extra_link_args=list(cpu.ldflags),
        )
        for capability in capabilities
    ]
    if _build_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _build.DEFAULT_CUDA_ARCH_LIST)
        cuda = _build.EXTENSIONS["cuda"]
        modules.append(
            cpp_extension.CUDAExtension(
                f"{PACKAGE}.ops._lib.cuda",
                sources=[str(CSRC / source) for source in cuda.sources],
                depends=headers,
                include_dirs=[str(CSRC.resolve())],
                extra_compile_args={"cxx": [*cuda.cflags, NO_DEBUG], "nvcc": list(cuda.cuda_cflags)},
                extra_link_args=list(cuda.ldflags),
            )
        )
    return modules


class BuildKernels(cpp_extension.BuildExtension if torch is not None else build_ext):
    """Compiles the wheel's kernels, the extensions in parallel, and writes ops/_lib/build.json; builds
    nothing for editable and in-place builds."""

    def run(self) -> None:
        if self.editable_mode or self.inplace:
            print(
                f"{PACKAGE}: an editable or in-place build: the kernels compile on first use (ops/_loader.py)"
            )
            return
        if torch is None:
            raise SystemExit(
                f"{PACKAGE}'s wheel compiles its kernels against the torch they will run with: install "
                "torch, then build without pip's isolated environment: pip wheel --no-build-isolation ."
            )
        super().run()
        libraries = {}
        for ext in self.extensions:
            path = Path(self.get_ext_filename(ext.name))
            libraries[ext.name.rsplit(".", 1)[1]] = {
                "path": str(path.relative_to(PACKAGE)),
                **_build.library_record(Path(self.build_lib, path)),
            }
        info = {
            "torch": torch.__version__,
            "libraries": libraries,
            "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST") if "cuda" in libraries else None,
        }
        Path(self.build_lib, PACKAGE, "ops", "_lib", "build.json").write_text(
            json.dumps(info, indent=2) + "\n"
        )

    def build_extensions(self) -> None:
        # One translation unit per instruction set: the capabilities share fused_sgd.cpp, and objects are
        # named after their source, so each compiles a one-line file of its own that includes it.
        for ext in self.extensions:
            library = ext.name.rsplit(".", 1)[1]
            unit = Path(self.build_temp, "capabilities", f"{library}.cpp").resolve()
            if library.startswith("cpu_") and ext.sources != [str(unit)]:
                unit.parent.mkdir(parents=True, exist_ok=True)
                text = f'#include "{Path(ext.sources[0]).name}"\n'
                if not unit.exists() or unit.read_text() != text:  # kept as is: an unchanged build is skipped
                    unit.write_text(text)
                ext.depends = [*ext.depends, *ext.sources]
                ext.sources = [str(unit)]
        super().build_extensions()


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildKernels.with_options(use_ninja=False) if torch is not None else BuildKernels},
    # ninja writes one build.ninja per build directory, so parallel extensions compile without it
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
)
