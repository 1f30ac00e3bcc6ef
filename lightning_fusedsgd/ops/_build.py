"""How the kernels are built, for the wheel (setup.py) and for the build on first use (``_loader``): sources,
flags, the CPU instruction sets, the CUDA toolkit, the cache key, and the record that makes a built library
trustworthy. Standard library only: setup.py loads this file before anything else of the package.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

CSRC = Path(__file__).parent / "csrc"
# `#include "name"`: a header of csrc/ (the system's and torch's are `<...>`).
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class Extension:
    """One compiled library: what it is built from and how.

    Attributes:
        namespace: The ``torch.ops`` namespace its kernels register under (``LFSGD_DEVICE_LIBRARY`` in the
            device's csrc/device_*.h).
        per_cpu_capability: Built with the flags of one of ``CPU_CAPABILITIES`` (the CPU's, as torch picks
        it). in_wheel: Shipped prebuilt in the wheel (else built on first use only).
    """

    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    namespace: str = "lightning_fusedsgd"
    per_cpu_capability: bool = False
    in_wheel: bool = True


# -ffp-contract=off / --fmad=false: no multiply-add is fused behind the code's back. The kernels fuse exactly
# where ATen's kernels do (sgd_math.h), which is what gives torch.optim.SGD's bits.
EXTENSIONS = {
    "cpu": Extension(
        "lightning_fusedsgd_C",
        ("fused_sgd.cpp",),
        ("-O3", "-fopenmp", "-ffp-contract=off"),
        ("-fopenmp",),
        per_cpu_capability=True,
    ),
    "cuda": Extension(
        "lightning_fusedsgd_cuda", ("fused_sgd_cuda.cu",), ("-O3",), (), ("-O3", "--fmad=false")
    ),
    # The CUDA source built by the host compiler, its kernels run on the CPU under an emulation of CUDA's
    # execution model (csrc/emulation/): for the tests, not shipped prebuilt. With the CPU library's
    # capability flags, so that both fuse multiply-adds alike (as CUDA does where the CPU has FMA).
    "cuda_emulated": Extension(
        "lightning_fusedsgd_cuda_emulated",
        ("emulation/fused_sgd_cuda_emulated.cpp",),
        ("-O2", "-ffp-contract=off"),
        namespace="lightning_fusedsgd_cuda_emulated",
        per_cpu_capability=True,
        in_wheel=False,
    ),
}
"""The libraries by kind: ``cpu``, ``cuda``, and ``cuda_emulated``."""

CPU_CAPABILITIES = {
    "default": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"),
}
"""The CPU library's builds, lowest first, with the flags of the features torch checks before it reports its
AVX2 capability (AVX2, FMA; F16C, which every AVX2 CPU has) and its AVX512 one (AVX-512 F/BW/VL/DQ, FMA): each
build runs where torch runs ATen's kernels of that capability, and rounds as they do (fused multiply-adds
exactly where FMA is in the flags). ``CPU_CAPABILITY_*`` gives ATen's vectors (at::vec) the capability's
instructions, on which the 16-bit loops run."""

DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"  # A100, H100/H200 machine code; PTX for later GPUs
CACHE_ENV = "LIGHTNING_FUSEDSGD_CACHE"


def cpu_flags(capability: str) -> list[str]:
    """The CPU library's compiler flags for one capability of ``CPU_CAPABILITIES``."""
    return [*EXTENSIONS["cpu"].cflags, *CPU_CAPABILITIES[capability]]


def cache_dir() -> Path:
    """Where libraries built on first use are kept: ``$LIGHTNING_FUSEDSGD_CACHE``, else
    ``~/.cache/lightning_fusedsgd``."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "lightning_fusedsgd"))


def source_files(device_type: str) -> list[str]:
    """The files of csrc/ the library is compiled from: its sources and the headers they include, directly or
    not (both branches of a conditional include)."""
    files: list[str] = []
    pending = list(EXTENSIONS[device_type].sources)
    while pending:
        name = pending.pop()
        if name not in files:
            files.append(name)
            included = _LOCAL_INCLUDE.findall((CSRC / name).read_text(encoding="utf-8"))
            pending.extend(_included_file(include, name) for include in included)
    return sorted(files)


def _included_file(include: str, including: str) -> str:
    """The file of csrc/ an ``#include "..."`` names, as the compiler finds it: beside the including file,
    else in csrc/ (the include path)."""
    beside = (PurePosixPath(including).parent / include).as_posix()
    return beside if (CSRC / beside).exists() else include


def build_key(device_type: str, *parts: str) -> str:
    """A hash of the files the library is compiled from, its flags and ``parts`` (what else it depends on: the
    torch it links against, the Python, the instruction set or the CUDA toolkit and architectures)."""
    extension = EXTENSIONS[device_type]
    digest = hashlib.sha256()
    for name in source_files(device_type):
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    for part in (*extension.cflags, *extension.ldflags, *extension.cuda_cflags, platform.machine(), *parts):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def cuda_toolkit() -> tuple[Path | None, str]:
    """The CUDA toolkit to compile with, and how it was found or why none was.

    ``CUDA_HOME`` (or ``CUDA_PATH``) when set; otherwise the toolkit the ``nvcc`` on PATH belongs to. That
    nvcc may be a wrapper script outside the toolkit (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``), whose
    parent folder torch would take as the toolkit, failing at ``-lcudart``: nvcc's ``--dryrun`` names its real
    installation (``TOP``). A toolkit without ``cuda_runtime.h`` and ``libcudart`` is no toolkit."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            return Path(os.environ[variable]), f"${variable}"
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None, "no nvcc on PATH and CUDA_HOME is not set"
    try:
        dryrun = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"{nvcc} does not run ({error})"
    top = re.search(r"^#\$ TOP=(.+)$", dryrun.stdout + dryrun.stderr, re.MULTILINE)
    if top is None:
        return None, f"{nvcc} --dryrun does not name its toolkit"
    toolkit = Path(top.group(1).strip()).resolve()
    runtime = [*toolkit.glob("lib64/libcudart.so*"), *toolkit.glob("lib/libcudart.so*")]
    if not (toolkit / "include" / "cuda_runtime.h").exists() or not runtime:
        return (
            None,
            f"{nvcc} belongs to {toolkit}, which has no CUDA runtime (include/cuda_runtime.h, libcudart)",
        )
    return toolkit, f"the toolkit of {nvcc}"


def library_record(path: Path) -> dict[str, str | int]:
    """What a complete library file is: its size and SHA-256, recorded when it is built."""
    return {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def library_problem(path: Path, record: dict[str, str | int] | None) -> str | None:
    """Why ``path`` is not the library ``record`` describes (missing, cut short, changed), or None. Checked
    before ``dlopen``: a truncated shared object kills the process with SIGBUS when it is mapped."""
    if record is None:
        return "it has no build record"
    if not path.is_file():
        return f"{path} is missing"
    try:
        size = path.stat().st_size
        if size != record.get("size"):
            return f"{path} has {size} bytes, {record.get('size')} were built"
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as error:
        return f"{path} cannot be read ({error})"
    return None if digest == record.get("sha256") else f"{path} changed after it was built"


def read_record(path: Path) -> dict[str, str | int] | None:
    """A build record written by :func:`write_record`, or None (absent or unreadable)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(library: Path, record_path: Path) -> None:
    """Records ``library`` as complete (written last: a build that stops before has no record)."""
    record_path.write_text(json.dumps(library_record(library)) + "\n", encoding="utf-8")
