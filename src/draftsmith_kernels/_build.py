"""What the kernels of this package share: the mode that picks kernel or reference
(DRAFTSMITH_KERNELS=ref|cuda|auto, or `use`), and building one kernel on first use.

Each .cu includes CUDA's headers only (no torch header) and exports C functions: nvcc alone
makes it a shared library in seconds (soft_ce.cu: 3.7 s on a 2-core CPU, against 96 s with
torch/extension.h through torch.utils.cpp_extension, 50.6 s on the H100 host), loaded with
ctypes; the Python shim checks the arguments and allocates the outputs. Built for sm_90 (the
H200 target) plus the running device's own arch, the CUDA runtime linked in statically (it
shares torch's context and streams), and kept in a folder keyed by the source, the compiler's
version and the archs (`build_directory`), so a second run loads it instead of building."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

MODES = ("auto", "ref", "cuda")
ENV = "DRAFTSMITH_KERNELS"
CACHE_ENV = "DRAFTSMITH_KERNEL_CACHE"  # where built kernels are kept (default below)
_mode: str | None = None  # set by use(); None defers to the environment


def use(mode: str | None) -> None:
    """Override DRAFTSMITH_KERNELS for this process: 'auto', 'ref', 'cuda', or None to defer."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
    global _mode
    _mode = mode


def current_mode() -> str:
    mode = _mode or os.environ.get(ENV, "auto")
    if mode not in MODES:
        from draftsmith.errors import DraftsmithError

        raise DraftsmithError(f"the environment variable {ENV} is {mode!r}",
                              f"set it to one of {', '.join(MODES)}, or unset it (auto)")
    return mode


def build_directory(name: str, source: Path, archs, compiler: str) -> Path:
    """The folder this build is kept in: one per source text, compiler version and archs, so a
    changed source or another toolkit builds anew instead of loading a stale binary."""
    key = hashlib.sha256(source.read_bytes())
    key.update(f"{compiler} {sorted(archs)}".encode())
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "draftsmith" / "kernels")
    folder = root / f"{name}-{key.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def find_nvcc() -> str | None:
    """nvcc under CUDA_HOME (or CUDA_PATH), else on PATH, else the usual /usr/local/cuda."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None


def compile_library(nvcc: str, source: Path, archs, out: Path) -> None:
    """nvcc source -> the shared library `out`, written beside it and renamed into place (two
    processes building at once each rename a whole file; a killed build leaves none)."""
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        subprocess.run([nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
                        "-cudart", "static", *gencode, "-o", str(tmp), str(source)],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def build(name: str, source: str, archs=None):
    """-> (ctypes library, None, None), or (None, reason, error) when it cannot be built here.
    archs: the archs to build for (default: sm_90 and the running device's)."""
    if archs is None:
        if not torch.cuda.is_available():
            return None, "no CUDA device", None
        major, minor = torch.cuda.get_device_capability()
        archs = list(dict.fromkeys(["90", f"{major}{minor}"]))
    nvcc = find_nvcc()
    if nvcc is None:
        return None, "nvcc not found (set CUDA_HOME, or put the CUDA toolkit's bin on PATH)", None
    try:
        version = subprocess.run([nvcc, "--version"], check=True, capture_output=True,
                                 text=True).stdout.strip().splitlines()[-1]
        path = Path(__file__).with_name(source)
        lib = build_directory(name, path, archs, version) / f"{name}.so"
        if not lib.exists():
            compile_library(nvcc, path, archs, lib)
        return ctypes.CDLL(str(lib)), None, None
    except subprocess.CalledProcessError as e:  # the compiler's own words: its first error
        lines = (e.stderr or "").strip().splitlines() or [str(e)]
        first = next((line for line in lines if "error" in line.lower()), lines[0])
        return None, f"build failed: {first[:300]}", e
    except OSError as e:  # an unloadable library, a read-only cache folder...
        return None, f"build failed: {type(e).__name__}: {e}", e
