"""Loads the compiled kernels into ``torch.ops.lightning_fusedsgd``: the wheel's libraries, else the ones
built on first use.

Where the libraries come from, in order:

1. **The wheel** (``pip wheel --no-build-isolation .``, see setup.py): prebuilt libraries under ``ops/_lib/``.
   The CPU library is built once per instruction set of ``_build.CPU_CAPABILITIES``, each a whole library, and
   the one torch's own CPU capability names is loaded (``ATEN_CPU_CAPABILITY`` lowers torch's, and so ours;
   ``LIGHTNING_FUSEDSGD_CPU_CAPABILITY`` lowers ours alone). Whole libraries rather than per-ISA namespaces in
   one: inline functions of the headers (ours and torch's) compiled with AVX-512 flags would otherwise be
   merged by the linker into code that the baseline path calls too. The CUDA library is there when the wheel
   was built with a CUDA toolkit, for the architectures in ``_lib/build.json``. The libraries link against one
   torch's C++ API (the LibTorch stable ABI cannot express the ``KeptPlan`` class or the dispatcher calls), so
   ``build.json`` records that torch, and a library is only loaded under it, and only where its size and
   SHA-256 are those recorded.
2. **Built on first use** (editable installs, ``make install``; and the fallback where the wheel's library
   cannot be used, with one message saying why): with the same flags as the wheel's library of this
   capability, through ``torch.utils.cpp_extension`` and ninja, cached under ``$LIGHTNING_FUSEDSGD_CACHE``
   (default ``~/.cache/lightning_fusedsgd``) by a hash of sources, flags, torch, Python and the instruction
   set (CUDA: the toolkit and the GPUs' architectures). A build's record (size, SHA-256) is written last and
   checked before every load, so a library cut short (a full disk) is rebuilt rather than mapped.

``python -m lightning_fusedsgd`` loads (or builds) them and says which. Where nothing can be loaded,
:class:`KernelBuildError` says why and how to fix it; the optimizer's backend policy falls back to the
reference with one warning (``LIGHTNING_FUSEDSGD_REQUIRE_COMPILED=1``, set by CI, makes that an error)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from lightning_fusedsgd import _abi
from lightning_fusedsgd.ops import _build

REQUIRE_COMPILED_ENV = "LIGHTNING_FUSEDSGD_REQUIRE_COMPILED"
CPU_CAPABILITY_ENV = "LIGHTNING_FUSEDSGD_CPU_CAPABILITY"
PACKAGE_ROOT = Path(__file__).parents[1]  # build.json's library paths are relative to it
PREBUILT = Path(__file__).parent / "_lib"  # the wheel's libraries and build.json (absent in a source tree)


class KernelBuildError(RuntimeError):
    """The compiled kernel could not be built or loaded; the message says why and how to fix it."""


# The outcome of loading each device type's library (its path, or why it failed), once per process. A plain
# dict, so that a step traced by torch.compile reads it without a graph break once the library is loaded.
OUTCOMES: dict[str, Path | KernelBuildError] = {}


def load(device_type: str = "cpu", verbose: bool = False) -> Any:
    """The ops namespace with the kernel for ``device_type`` registered, loading (or building) it on first
    use: ``torch.ops.lightning_fusedsgd`` for "cpu" and "cuda", ``torch.ops.lightning_fusedsgd_cuda_emulated``
    for "cuda_emulated" (the CUDA kernels run on CPU tensors under an emulation of CUDA, for the tests). The
    outcome, a library or a failure, is kept for the process. The CUDA libraries register kernels for ops
    whose ABI the CPU library's checks cover, so they load that first.

    Raises:
        KernelBuildError: There is no kernel for ``device_type``, or no library could be loaded or built.
    """
    if device_type not in _build.EXTENSIONS:
        raise KernelBuildError(f"lightning_fusedsgd has no compiled kernel for {device_type} tensors")
    for needed in dict.fromkeys(("cpu", device_type)):
        if needed not in OUTCOMES:
            try:
                OUTCOMES[needed] = _load(needed, verbose)
            except KernelBuildError as error:
                OUTCOMES[needed] = error
        outcome = OUTCOMES[needed]
        if isinstance(outcome, KernelBuildError):
            raise outcome
    return getattr(torch.ops, _build.EXTENSIONS[device_type].namespace)


def is_loaded(device_type: str) -> bool:
    """Whether the library for ``device_type`` is loaded (no attempt is made)."""
    return isinstance(OUTCOMES.get(device_type), Path)


def cpu_capability() -> str:
    """The instruction set of the CPU library to load: torch's CPU capability (its own pick for ATen's
    kernels; ``ATEN_CPU_CAPABILITY`` lowers it), or a lower one named by
    ``LIGHTNING_FUSEDSGD_CPU_CAPABILITY``."""
    names = list(_build.CPU_CAPABILITIES)
    supported = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "default")
    requested = os.environ.get(CPU_CAPABILITY_ENV, supported)
    if requested not in names:
        raise KernelBuildError(f"{CPU_CAPABILITY_ENV}={requested!r}: use one of {', '.join(names)}")
    if names.index(requested) > names.index(supported):
        raise KernelBuildError(
            f"{CPU_CAPABILITY_ENV}={requested!r}, but this CPU runs at most {supported!r}: lower or unset it"
        )
    return requested


_ARCH = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


def cuda_arch_problem(arch_list: str, capabilities: list[tuple[int, int]]) -> str | None:
    """Why a CUDA library built for ``arch_list`` (``TORCH_CUDA_ARCH_LIST`` syntax) cannot run on GPUs of
    these compute capabilities, or None. Machine code runs on its major version at the same or a later minor;
    "a" (architecture-specific, ``9.0a``) code only on exactly that version; "f" (family-specific, ``10.0f``)
    on its major version at the same or a later minor; PTX on any later GPU (the driver compiles it)."""
    archs = []
    for arch in arch_list.replace(" ", ";").split(";"):
        if not arch:
            continue
        match = _ARCH.match(arch.strip())
        if match is None:
            return f"it was built for CUDA architectures {arch_list!r}, of which {arch!r} cannot be read"
        major, minor, suffix, ptx = match.groups()
        archs.append(((int(major), int(minor)), suffix, ptx is not None))
    for device in capabilities:
        if not any(_runs_on(arch, suffix, ptx, tuple(device)) for arch, suffix, ptx in archs):
            return f"it was built for CUDA architectures {arch_list}, this GPU is {device[0]}.{device[1]}"
    return None


def _runs_on(arch: tuple[int, int], suffix: str, ptx: bool, device: tuple[int, int]) -> bool:
    if ptx and suffix == "" and arch <= device:
        return True
    if suffix == "a":
        return arch == device
    return arch[0] == device[0] and arch[1] <= device[1]


def _build_info() -> dict[str, Any] | None:
    """The wheel's build.json: the torch it was built for and its libraries; None in a source tree.

    Raises:
        ValueError: If it cannot be read or is not laid out as setup.py writes it.
    """
    path = PREBUILT / "build.json"
    if not path.exists():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} cannot be read ({error})") from error
    libraries = info.get("libraries") if isinstance(info, dict) else None
    if not (
        isinstance(libraries, dict)
        and isinstance(info.get("torch"), str)
        and all(
            isinstance(entry, dict) and isinstance(entry.get("path"), str) for entry in libraries.values()
        )
        and ("cuda" not in libraries or isinstance(info.get("cuda_arch_list"), str))
    ):
        raise ValueError(f"{path} is not laid out as setup.py writes it")
    return info


def _prebuilt_library(device_type: str) -> tuple[Path | None, str | None]:
    """The wheel's library for ``device_type`` on this machine, or why it cannot be used; (None, None) where
    there is no wheel (a source tree: built on first use, as designed)."""
    try:
        info = _build_info()
    except ValueError as error:
        return None, f"its build record is damaged: {error}"
    if info is None or not _build.EXTENSIONS[device_type].in_wheel:
        return None, None
    if info["torch"] != torch.__version__:
        return None, f"it was built for torch {info['torch']}, this is torch {torch.__version__}"
    name = f"cpu_{cpu_capability()}" if device_type == "cpu" else device_type
    if name not in info["libraries"]:
        return None, f"the wheel was built without a {name} library"
    if device_type == "cuda":
        capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        problem = cuda_arch_problem(info["cuda_arch_list"], capabilities)
        if problem is not None:
            return None, problem
    entry = info["libraries"][name]
    library = PACKAGE_ROOT / entry["path"]
    problem = _build.library_problem(library, entry)
    if problem is not None:
        return None, f"its library is damaged: {problem}"
    return library, None


@torch.compiler.disable  # loading is never traced (a graph break, before the first load only)
def _load(device_type: str, verbose: bool) -> Path:
    """Loads the wheel's library for ``device_type``, else the one built from source."""
    library, problem = _prebuilt_library(device_type)
    if library is not None:
        try:
            torch.ops.load_library(str(library))
        except OSError as error:
            problem = f"it does not load: {error}"
        else:
            return _registered(device_type, library)
    return _build_and_load(device_type, verbose, problem)


def _registered(device_type: str, library: Path) -> Path:
    """Checks that the kernels read every table as ``_abi`` says (``_abi.kernel_tables``), and hold the state
    slots ``_abi.SLOTS`` declares, in their dtypes."""
    if device_type == "cpu":
        ops = torch.ops.lightning_fusedsgd
        for op, python, what in _abi.kernel_tables():
            kernel = tuple(getattr(ops, op)())
            if kernel != python:
                raise KernelBuildError(
                    f"the kernel in {library} reads the {what} as {kernel} ({op}), _abi.py says {python}: "
                    "keep ops/csrc/sgd_math.h and schedule.h in the order of _abi.py"
                )
        _compare_slot_rules(library)
    return library


def _compare_slot_rules(library: Path) -> None:
    """Compares the kernels' held and dtype rules of each slot (``LFSGD_SLOTS`` in ops/csrc/slots.h) with
    ``_abi.SLOTS``' for every param dtype and every combination of the plan options."""
    groups, table = _abi.slot_rule_cases()
    masters = [bool(group["master_weights"]) for group in groups]
    for dtype in _abi.PARAM_DTYPES:
        held, dtypes = torch.ops.lightning_fusedsgd.slot_rules(table, dtype, masters)
        kernel = iter(zip(held, (t.dtype for t in dtypes)))
        for group in groups:
            for slot in _abi.SLOTS:
                says, python = next(kernel), (slot.held(group, dtype), slot.dtype(group, dtype))
                if says != python:
                    raise KernelBuildError(
                        f"the kernel in {library} gives {dtype} params of a group with {group} "
                        f"(held, dtype) {says} for {slot.key}, _abi.SLOTS says {python}: keep the rules of "
                        "LFSGD_SLOTS in ops/csrc/slots.h those of _abi.py"
                    )


def _cpp_extension() -> ModuleType:
    """torch.utils.cpp_extension, quiet, compiling CUDA with the toolkit nvcc belongs to
    (``_build.cuda_toolkit``), which torch's own guess (the parent of nvcc's folder) misses where nvcc is a
    wrapper script."""
    # cpp_extension logs a CUDA_HOME notice at import on machines without CUDA; it is irrelevant here.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import cpp_extension

    toolkit, _ = _build.cuda_toolkit()
    if toolkit is not None:
        cpp_extension.CUDA_HOME = str(toolkit)
    return cpp_extension


def _machine(device_type: str) -> tuple[str, ...]:
    """What a build for ``device_type`` depends on besides its sources and flags."""
    if _build.EXTENSIONS[device_type].per_cpu_capability:
        return (cpu_capability(),)
    toolkit, how = _build.cuda_toolkit()
    capabilities = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    return (str(toolkit), how, str(torch.version.cuda), arch_list, str(capabilities))


def _build_and_load(device_type: str, verbose: bool, prebuilt_problem: str | None = None) -> Path:
    """Loads the library built from source, building it first where the cache has no complete one.
    ``prebuilt_problem``: why the wheel's library is not used (None: there is no wheel)."""
    unused = (
        f"the wheel's {device_type} kernel cannot be used ({prebuilt_problem}); " if prebuilt_problem else ""
    )
    try:
        return _build_in_cache(device_type, verbose, unused)
    except OSError as error:  # the cache itself: read-only, under a file, full
        raise KernelBuildError(
            f"{unused}the lightning_fusedsgd kernel cache {_build.cache_dir()} cannot be used ({error}): "
            f"set {_build.CACHE_ENV} to a writable directory, or run `python -m lightning_fusedsgd` once "
            "where it is writable"
        ) from error


def cache_entry(device_type: str) -> tuple[str, Path, Path]:
    """Where the library for ``device_type`` built on this machine is cached: its name, its file and its build
    record (written after a complete build; the library's size and hash are checked against it before
    loading)."""
    # torch by its release and commit, not its path: a new virtual environment with the same torch loads
    # the library built in another rather than compiling it again.
    key = _build.build_key(
        device_type, torch.__version__, torch.version.git_version, sys.version, *_machine(device_type)
    )
    name = f"{_build.EXTENSIONS[device_type].name}_{key}"
    build_dir = _build.cache_dir() / key
    return name, build_dir / f"{name}.so", build_dir / "ready"


def _build_in_cache(device_type: str, verbose: bool, unused: str) -> Path:
    extension = _build.EXTENSIONS[device_type]
    name, library, record = cache_entry(device_type)
    build_dir = library.parent
    problem = _build.library_problem(library, _build.read_record(record))
    if problem is None:
        torch.ops.load_library(str(library))  # directly: skips the toolchain check of cpp_extension.load
        if unused:
            print(
                f"lightning_fusedsgd: {unused}loading it as compiled from source: {library}", file=sys.stderr
            )
        return _registered(device_type, library)
    damaged = library.exists() and record.exists()
    build_dir.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)
    library.unlink(missing_ok=True)  # a damaged library is never mapped (SIGBUS), and is rebuilt from scratch
    reason = f"the cached library is damaged ({problem}); " if damaged else ""
    print(
        f"lightning_fusedsgd: {unused}{reason}compiling the {device_type} kernel into {build_dir} "
        f"(first use only, {'about a minute' if device_type != 'cuda' else 'a minute or two'})",
        file=sys.stderr,
    )
    cpp_extension = _cpp_extension()
    capability_flags = list(_build.CPU_CAPABILITIES[cpu_capability()]) if extension.per_cpu_capability else []
    try:
        cpp_extension.load(
            name=name,
            sources=[str(_build.CSRC / source) for source in extension.sources],
            extra_cflags=[*extension.cflags, *capability_flags],
            extra_cuda_cflags=list(extension.cuda_cflags),
            extra_ldflags=list(extension.ldflags),
            extra_include_paths=[str(_build.CSRC)],
            build_directory=str(build_dir),
            verbose=verbose,
            is_python_module=False,
        )
    # The toolchain raises many types: compiler or ninja missing, compile and link errors.
    except Exception as error:
        toolchain = "a C++ compiler (g++) and ninja" + (
            " and the CUDA toolkit (nvcc)" if device_type == "cuda" else ""
        )
        raise KernelBuildError(
            f"{unused}could not build the lightning_fusedsgd {device_type} kernel in {build_dir}: {error}. "
            f"Install {toolchain}, or a wheel built for torch {torch.__version__} (docs: Installing), or use "
            "FusedSGD(..., backend='reference')."
        ) from error
    _build.write_record(library, record)
    return _registered(device_type, library)


def main(argv: list[str] | None = None) -> int:
    """Loads the kernels, building them where the wheel has none for this machine:
    ``python -m lightning_fusedsgd [--verbose]`` (CUDA's where a GPU is seen)."""
    parser = argparse.ArgumentParser(description="Load, or build and cache, the lightning_fusedsgd kernels.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    status = 0
    for device_type in ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]:
        try:
            load(device_type, verbose=args.verbose)
        except KernelBuildError as error:
            print(f"lightning_fusedsgd: {error}", file=sys.stderr)
            # Without a CUDA toolkit, CUDA steps fall back with a warning (as at run time); only the CPU
            # kernel, or CI's switch, makes a failed build fatal.
            if device_type == "cpu" or os.environ.get(REQUIRE_COMPILED_ENV) == "1":
                status = 1
            continue
        print(f"lightning_fusedsgd {device_type} kernel ready: {OUTCOMES[device_type]}")
    return status
