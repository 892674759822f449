"""Per-row fp8 (e4m3) quantization of hidden states, for storage: a CUDA kernel (fp8_rows.cu) for
CUDA tensors, its PyTorch reference otherwise. DRAFTSMITH_KERNELS=ref|cuda|auto applies as for
soft_ce (`cuda` raises when the kernel cannot be used).

Each row (one token's state entering one layer) gets its own scale, absmax / 448, so a token
whose residual stream is large (later layers, attention sinks) keeps its relative precision.
The decode, plain PyTorch, is draftsmith.hidden_format.dequantize: readers of the hidden
states need not import this module (nor build the kernel).
"""

from __future__ import annotations

import ctypes
import threading
import warnings

import torch

from draftsmith_kernels._build import build, current_mode

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # fp8_rows.cu's numbering

_lock = threading.Lock()
_built = False
_ext = None
_reason = ""
_error: Exception | None = None  # the build's own error, with the compiler output
_warned = False


def _extension():
    global _built, _ext, _reason, _error
    with _lock:
        if not _built:
            _built = True
            _ext, reason, _error = build("draftsmith_fp8_rows", "fp8_rows.cu")
            _reason = reason or ""
            if _ext is not None:
                bind(_ext)
        return _ext


def bind(lib) -> None:
    """Declare the built library's C functions (fp8_rows.cu's signatures) to ctypes."""
    P = ctypes.c_void_p
    lib.draftsmith_fp8_rows.argtypes = [P, ctypes.c_int, P, P, ctypes.c_int64, ctypes.c_int64, P]
    lib.draftsmith_fp8_rows.restype = ctypes.c_int
    lib.draftsmith_fp8_rows_error.argtypes = [ctypes.c_int]
    lib.draftsmith_fp8_rows_error.restype = ctypes.c_char_p


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, C) bf16/fp16/fp32 -> (q (N, C) float8_e4m3fn, scale (N,) fp32), x ~= q * scale."""
    if x.dim() != 2:
        raise ValueError(f"x must be (N, C), got {tuple(x.shape)}")
    mode = current_mode()
    if mode == "ref" or (mode == "auto" and not x.is_cuda):
        return quantize_ref(x)
    ext = _extension()
    if ext is None:
        if mode == "cuda":
            raise RuntimeError(f"the fp8_rows CUDA kernel is unavailable: {_reason}") from _error
        global _warned
        if not _warned:
            _warned = True
            warnings.warn(f"draftsmith_kernels: the fp8_rows CUDA kernel is unavailable "
                          f"({_reason}); using the PyTorch reference", RuntimeWarning)
        return quantize_ref(x)
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be one of {tuple(_DTYPES)}, got {x.dtype}")
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    with torch.cuda.device(x.device):  # the device whose context the launch uses
        code = ext.draftsmith_fp8_rows(x.data_ptr(), _DTYPES[x.dtype], q.data_ptr(),
                                       scale.data_ptr(), x.shape[0], x.shape[1],
                                       torch.cuda.current_stream().cuda_stream)
    if code != 0:
        raise RuntimeError(f"the fp8_rows kernel failed to launch: "
                           f"{ext.draftsmith_fp8_rows_error(code).decode()} (CUDA error {code})")
    return q, scale


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize in plain PyTorch (same contract)."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale
