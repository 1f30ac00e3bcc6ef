"""Builds the wheel's kernels ahead of time (README: "Installing from a wheel"); the metadata is in
pyproject.toml.

``pip wheel --no-build-isolation .`` compiles, against the torch installed here:
- the CPU kernel once per instruction set of ``kernels.CPU_CAPABILITIES`` (x86-64; baseline only elsewhere),
  each a whole library, ``lightning_fusedsgd/_lib/cpu_<capability>``;
- the CUDA kernel, ``_lib/cuda``, where torch has CUDA and nvcc is found, for ``TORCH_CUDA_ARCH_LIST``
  (default ``DEFAULT_CUDA_ARCH_LIST``); ``LIGHTNING_FUSEDSGD_BUILD_CUDA=0`` turns it off, ``=1`` makes a
  missing nvcc an error;
and records in ``_lib/build.json`` the torch version and the libraries, which ``kernels.py`` reads at load.
Editable installs (``make install``) build nothing: the kernels compile on first use there.
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
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"  # A100, H100/H200 machine code; PTX for later GPUs
PACKAGE = "lightning_fusedsgd"
CSRC = Path(PACKAGE, "csrc")
NO_DEBUG = "-g0"  # Python's own compiler flags add -g: 6 MB instead of 0.5 MB a library
HEADERS = sorted(str(path) for path in CSRC.glob("*.h"))

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # an isolated build environment: fine for editable installs only
    torch = None


def _kernels():
    """lightning_fusedsgd/kernels.py, loaded alone (the package's __init__ needs its dependencies): the
    build flags, written once for the wheel and for the build on first use."""
    spec = importlib.util.spec_from_file_location("_lfsgd_kernels", Path(PACKAGE, "kernels.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _build_cuda() -> bool:
    switch = os.environ.get(BUILD_CUDA_ENV, "")
    if switch == "0":
        return False
    available = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if switch == "1" and not available:
        missing = "this torch has no CUDA" if torch.version.cuda is None else "nvcc is not found"
        raise SystemExit(f"{BUILD_CUDA_ENV}=1, but {missing} (set CUDA_HOME to the CUDA toolkit)")
    return available


def extensions() -> list[Extension]:
    if torch is None:  # no kernel can be described without torch; BuildKernels says why where it matters
        return [Extension(f"{PACKAGE}._lib.cpu_default", sources=[])]
    kernels = _kernels()
    capabilities = (
        list(kernels.CPU_CAPABILITIES) if platform.machine() in ("x86_64", "AMD64") else ["default"]
    )
    cpu = kernels.EXTENSIONS["cpu"]
    modules = [
        cpp_extension.CppExtension(
            f"{PACKAGE}._lib.cpu_{capability}",
            sources=[str(CSRC / source) for source in cpu.sources],
            depends=HEADERS,
            include_dirs=[str(CSRC.resolve())],
            extra_compile_args={
                "cxx": [*kernels.PREBUILT_CPU_CFLAGS, *kernels.CPU_CAPABILITIES[capability], NO_DEBUG]
            },
            extra_link_args=list(cpu.ldflags),
        )
        for capability in capabilities
    ]
    if _build_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCH_LIST)
        cuda = kernels.EXTENSIONS["cuda"]
        modules.append(
            cpp_extension.CUDAExtension(
                f"{PACKAGE}._lib.cuda",
                sources=[str(CSRC / source) for source in cuda.sources],
                depends=HEADERS,
                include_dirs=[str(CSRC.resolve())],
                extra_compile_args={"cxx": [*cuda.cflags, NO_DEBUG], "nvcc": list(cuda.cuda_cflags)},
                extra_link_args=list(cuda.ldflags),
            )
        )
    return modules


class BuildKernels(cpp_extension.BuildExtension if torch is not None else build_ext):
    """Compiles the wheel's kernels, the extensions in parallel, and writes _lib/build.json; builds nothing
    for editable and in-place builds."""

    def run(self) -> None:
        if self.editable_mode or self.inplace:
            print(f"{PACKAGE}: an editable or in-place build: the kernels compile on first use (kernels.py)")
            return
        if torch is None:
            raise SystemExit(
                f"{PACKAGE}'s wheel compiles its kernels against the torch they will run with: install "
                "torch, then build without pip's isolated environment: pip wheel --no-build-isolation ."
            )
        super().run()
        info = {
            "torch": torch.__version__,
            "libraries": {
                ext.name.rsplit(".", 1)[1]: str(Path(self.get_ext_filename(ext.name)).relative_to(PACKAGE))
                for ext in self.extensions
            },
            "cuda_arch_list": os.environ["TORCH_CUDA_ARCH_LIST"] if _build_cuda() else None,
        }
        Path(self.build_lib, PACKAGE, "_lib", "build.json").write_text(json.dumps(info, indent=2) + "\n")

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
