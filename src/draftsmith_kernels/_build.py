"""What the kernels of this package share: the mode that picks kernel or reference
(DRAFTSMITH_KERNELS=ref|cuda|auto, or `use`), and building one CUDA extension on first use
(torch cpp_extension) for sm_90 (the H200 target) plus the running device's own arch, kept in
a folder keyed by its source, torch and CUDA versions and archs (`build_directory`)."""

from __future__ import annotations

import hashlib
import os
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


def build_directory(name: str, source: Path, archs) -> Path | None:
    """The folder this build is kept in: one per source text, torch and CUDA version and archs,
    so a changed source or another torch builds anew instead of loading a binary built against
    another ABI (torch's own cache is keyed by source alone), and a second run on the machine
    loads it in a fraction of a second instead of a minute of nvcc. None where the user set
    TORCH_EXTENSIONS_DIR: torch's own layout there."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return None
    key = hashlib.sha256(source.read_bytes())
    key.update(f"{torch.__version__} {torch.version.cuda} {sorted(archs)}".encode())
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "draftsmith" / "kernels")
    folder = root / f"{name}-{key.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def build(name: str, source: str):
    """-> (module, None, None), or (None, reason, error) when it cannot be built here."""
    if not torch.cuda.is_available():
        return None, "no CUDA device", None
    try:
        from torch.utils import cpp_extension

        major, minor = torch.cuda.get_device_capability()
        archs = dict.fromkeys(["90", f"{major}{minor}"])
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        path = Path(__file__).with_name(source)
        ext = cpp_extension.load(name=name, sources=[str(path)],
                                 build_directory=build_directory(name, path, archs),
                                 extra_cflags=["-O3"], extra_cuda_cflags=["-O3", *gencode])
        return ext, None, None
    except Exception as e:  # no nvcc or ninja, a compiler error, a driver mismatch...
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        return None, f"build failed: {type(e).__name__}: {first_line}", e
