"""Soft cross-entropy of draft logits against the target's distribution over the same vocab,
with its gradient, in one fused CUDA kernel (soft_ce.cu) or its PyTorch reference.

`soft_ce` picks the kernel for CUDA tensors and the reference otherwise. The kernel is built on
first use by nvcc (seconds; kept by source, compiler and archs: _build.py), or beforehand in the
background (`prebuild`), and called through ctypes; if the build fails it warns once and the
reference takes over. DRAFTSMITH_KERNELS=ref|cuda|auto (or `use(...)`) overrides
the choice: `cuda` raises when the kernel cannot be used instead of falling back.
"""

from __future__ import annotations

import ctypes
import threading
import warnings

import torch

from draftsmith_kernels._build import ENV, MODES, build, current_mode, use  # noqa: F401

# Rows per reference chunk come from this budget of elements, so that its fp32 temporaries stay
# about 64 MB each whatever the vocab (tests lower it to cross chunk boundaries).
REF_CHUNK_ELEMENTS = 1 << 24

# float64 is for the reference only (exact CPU tests); the kernel takes the others.
_LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_TARGET_DTYPES = (torch.float32, torch.bfloat16, torch.float64)

_lock = threading.Lock()
_built = False
_ext = None
_reason = ""  # why the kernel is unavailable, once known
_error: Exception | None = None  # the build's own error, with the compiler output
_warned = False
_current_mode = current_mode  # the mode is shared by all kernels (_build.py)
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # soft_ce.cu's Dtype
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def _extension():
    """The compiled module, building it on the first call; None (reason in _reason) if it fails."""
    global _built, _ext, _reason, _error
    with _lock:
        if _built:
            return _ext
        _built = True
        _ext, reason, _error = build("draftsmith_soft_ce", "soft_ce.cu")
        _reason = reason or ""
        if _ext is not None:
            bind(_ext)
        return _ext


def bind(lib) -> None:
    """Declare the built library's C functions (soft_ce.cu's signatures) to ctypes."""
    lib.draftsmith_soft_ce.argtypes = [_P, ctypes.c_int, _P, ctypes.c_int] + [_P] * 6 + [
        _I64, _I64, _P]
    lib.draftsmith_soft_ce.restype = ctypes.c_int
    lib.draftsmith_soft_ce_error.argtypes = [ctypes.c_int]
    lib.draftsmith_soft_ce_error.restype = ctypes.c_char_p


def prebuild() -> None:
    """Build the kernel in a background thread (nvcc runs as a process of its own), so that a
    first build overlaps what the caller does next (the train stage: setting up and compiling
    its first step) instead of adding to it; the first soft_ce call waits for it. A no-op where
    there is no GPU, with DRAFTSMITH_KERNELS=ref, or once built."""
    if _current_mode() != "ref" and torch.cuda.is_available() and not _built:
        threading.Thread(target=_extension, name="soft_ce build", daemon=True).start()


def available() -> bool:
    """Whether the CUDA kernel can be used here (builds it on the first call)."""
    return _current_mode() != "ref" and _extension() is not None


def status() -> str:
    """'cuda kernel', or 'reference (why)'."""
    if _current_mode() == "ref":
        return "reference (forced by use('ref') or DRAFTSMITH_KERNELS=ref)"
    return "cuda kernel" if _extension() is not None else f"reference ({_reason})"


def soft_ce(logits, target_logits, row_scale, *, inplace: bool = False):
    """logits: (N, V) bf16/fp16/fp32 draft logits; target_logits: (N, V) fp32 or bf16 (the target's
    logits over the same vocab); row_scale: (N,) fp32.
    Returns (ce, target_neg_entropy, pred, target_pred, grad):
      ce (N,) fp32            = logsumexp(logits) - sum_v p_v * logits_v, p = softmax(target_logits)
      target_neg_entropy (N,) = sum_v p_v * log p_v   (so KL(p||q) = ce + target_neg_entropy)
      pred (N,) int64         = argmax(logits)  (first index on ties, like torch.argmax)
      target_pred (N,) int64  = argmax(target_logits)
      grad (N, V) logits.dtype = row_scale[:, None] * (softmax(logits) - p)   (d ce / d logits, scaled)
    With inplace=True, grad is written into `logits` and returned (no (N, V) allocation).
    All arithmetic in fp32. Never materialises an (N, V) fp32 tensor in the CUDA path.
    Inputs are expected finite (a NaN makes its row's ce NaN)."""
    _check(logits, target_logits, row_scale, inplace)
    mode = _current_mode()
    fp64 = torch.float64 in (logits.dtype, target_logits.dtype, row_scale.dtype)
    if mode == "ref" or (mode == "auto" and (not logits.is_cuda or fp64)):
        return soft_ce_ref(logits, target_logits, row_scale, inplace=inplace)
    ext = _extension()
    if ext is None:
        if mode == "cuda":
            raise RuntimeError(f"{ENV}=cuda (or use('cuda')) but the soft_ce CUDA kernel is "
                               f"unavailable: {_reason}") from _error
        _warn_once()
        return soft_ce_ref(logits, target_logits, row_scale, inplace=inplace)
    if not logits.is_cuda:
        raise ValueError(f"the soft_ce CUDA kernel was forced but logits are on {logits.device}")
    return _kernel(ext, logits, target_logits, row_scale, inplace)


def _kernel(ext, logits, target_logits, row_scale, inplace: bool):
    """soft_ce on the CUDA kernel: outputs allocated here, launched on torch's current stream
    of the logits' device."""
    n, v = logits.shape
    if n >= 2 ** 31 or v > 2 ** 30:  # one block per row in grid.x; int columns, with headroom
        raise ValueError(f"the soft_ce kernel takes N below 2^31 and V at most 2^30, got "
                         f"{tuple(logits.shape)}")
    # The kernel wants contiguous rows; logits already are when inplace (checked by _check).
    logits, target_logits = logits.contiguous(), target_logits.contiguous()
    row_scale = row_scale.contiguous()
    f32 = dict(dtype=torch.float32, device=logits.device)
    ce, neg_entropy = torch.empty(n, **f32), torch.empty(n, **f32)
    pred = torch.empty(n, dtype=torch.int64, device=logits.device)
    target_pred = torch.empty_like(pred)
    grad = logits if inplace else torch.empty_like(logits)
    with torch.cuda.device(logits.device):  # the device whose context the launch uses
        code = ext.draftsmith_soft_ce(
            logits.data_ptr(), _DTYPES[logits.dtype], target_logits.data_ptr(),
            _DTYPES[target_logits.dtype], row_scale.data_ptr(), grad.data_ptr(), ce.data_ptr(),
            neg_entropy.data_ptr(), pred.data_ptr(), target_pred.data_ptr(), n, v,
            torch.cuda.current_stream().cuda_stream)
    if code != 0:
        raise RuntimeError(f"the soft_ce kernel failed to launch: "
                           f"{ext.draftsmith_soft_ce_error(code).decode()} (CUDA error {code})")
    return ce, neg_entropy, pred, target_pred, grad


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"draftsmith_kernels: the soft_ce CUDA kernel is unavailable ({_reason}); "
                      "using the slower PyTorch reference. For the fast path install a CUDA "
                      "toolkit that this machine's driver supports, with nvcc on PATH or in "
                      "CUDA_HOME.",
                      RuntimeWarning, stacklevel=3)


def soft_ce_ref(logits, target_logits, row_scale, *, inplace: bool = False):
    """soft_ce in plain PyTorch (same contract), a chunk of rows at a time."""
    _check(logits, target_logits, row_scale, inplace)
    n, v = logits.shape
    acc = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    f32 = dict(dtype=acc, device=logits.device)
    ce, neg_entropy = torch.empty(n, **f32), torch.empty(n, **f32)
    pred = torch.empty(n, dtype=torch.int64, device=logits.device)
    target_pred = torch.empty_like(pred)
    grad = logits if inplace else torch.empty_like(logits)
    step = max(1, REF_CHUNK_ELEMENTS // v)
    with torch.no_grad():
        for r in range(0, n, step):
            rows = slice(r, r + step)
            # .to(acc) may return the logits themselves: everything read from them is computed
            # before grad (possibly the same memory) is written.
            l, t = logits[rows].to(acc), target_logits[rows].to(acc)
            log_q, log_p = torch.log_softmax(l, -1), torch.log_softmax(t, -1)
            p = log_p.exp()
            ce[rows] = -(p * log_q).sum(-1)
            neg_entropy[rows] = (p * log_p).sum(-1)
            pred[rows], target_pred[rows] = l.argmax(-1), t.argmax(-1)
            grad[rows] = row_scale[rows, None] * (log_q.exp() - p)
    return ce, neg_entropy, pred, target_pred, grad


def _check(logits, target_logits, row_scale, inplace: bool) -> None:
    """The contract both paths share, checked up front for the same errors on either."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be (N, V) with V >= 1, got {tuple(logits.shape)}")
    if target_logits.shape != logits.shape:
        raise ValueError(f"target_logits {tuple(target_logits.shape)} must have the shape of "
                         f"logits {tuple(logits.shape)}")
    if row_scale.shape != logits.shape[:1]:
        raise ValueError(f"row_scale must be (N,) = ({logits.shape[0]},), got "
                         f"{tuple(row_scale.shape)}")
    if logits.dtype not in _LOGITS_DTYPES:
        raise TypeError(f"logits must be one of {_LOGITS_DTYPES}, got {logits.dtype}")
    if target_logits.dtype not in _TARGET_DTYPES:
        raise TypeError(f"target_logits must be one of {_TARGET_DTYPES}, got {target_logits.dtype}")
    if row_scale.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"row_scale must be float32 (or float64), got {row_scale.dtype}")
    if not (logits.device == target_logits.device == row_scale.device):
        raise ValueError(f"logits, target_logits and row_scale must be on one device, got "
                         f"{logits.device}, {target_logits.device}, {row_scale.device}")
    if inplace and not logits.is_contiguous():
        raise ValueError("inplace=True needs contiguous logits (grad is written into them)")
