"""Attention for packed extraction: many samples end to end in one flat row, no padding, each
sample attending causally within itself only.

Registered with transformers as the attention implementation `draftsmith_varlen` (and a mask
function that builds no mask), so any decoder-only architecture whose attention goes through
transformers' attention interface runs packed: the hidden stage sets it on the target and calls
the model inside `documents(lengths)`, which says where each sample starts.

The kernel, by device (`KERNEL`):
- CUDA (`split`): samples of at least `LONG_TOKENS` through SDPA one at a time, and each run
  of shorter samples between them through `flash` below. On an H200 (torch 2.11, 32/8 heads of
  128) the varlen flash forward stays at 0.44 of the bf16 matmul rate however long a sample
  is, while SDPA on one sample (cuDNN's kernel) reaches 0.74-0.76 from 8K tokens on (0.46 at
  2K against flash's 0.37; at 1K half flash's speed): a long-tailed mix spends most of its
  attention FLOPs there (benchmarks/varlen_attention.py, benchmarks/results/README.md).
- CUDA (`flash`): torch's flash attention forward with cumulative sequence offsets
  (`aten::_flash_attention_forward`, which `varlen_attn` wraps), called directly: one call per
  layer for the whole row, fully masked blocks never computed, nothing padded, the KV heads of
  GQA read as they are and q/k/v taken as the strided (T, H, D) views the model hands over.
  On an H200, 8B shape, torch 2.11: the public `varlen_attn` (`varlen`) has no GQA there, and
  repeating the heads plus making them contiguous cost 4.8% of the forward's GPU time
  (benchmarks/results/README.md).
- elsewhere (and on request, `sdpa`): scaled_dot_product_attention once per sample, the
  reference the tests hold the CUDA paths to.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError

NAME = "draftsmith_varlen"
KERNEL = "auto"  # auto (split on CUDA, SDPA per sample elsewhere) | split | flash | varlen | sdpa
LONG_TOKENS = 2048  # split: samples at least this long go through SDPA alone


@dataclass(frozen=True)
class _Documents:
    lengths: tuple[int, ...]
    cu: torch.Tensor | None  # (n + 1,) int32 on the device: where each sample starts
    longest: int
    # `split`: the row cut into (start, stop, the run of short samples there, or None for one
    # long sample), planned once per forward so no layer waits on a host-to-device copy.
    parts: tuple = ()


_CURRENT: contextvars.ContextVar[_Documents | None] = contextvars.ContextVar(
    "draftsmith_packed_documents", default=None)


@contextlib.contextmanager
def documents(lengths: list[int], device):
    """Inside this block, a forward pass of a model set to `NAME` reads its flat row (1, sum
    of lengths) as these samples, in order."""
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(device)
    token = _CURRENT.set(_Documents(tuple(lengths), cu, max(lengths),
                                    _split_parts(lengths, device)))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _split_parts(lengths: list[int], device) -> tuple:
    """The row as `split` runs it: each sample of LONG_TOKENS or more alone, each run of
    shorter ones between them together (their offsets copied to the device in one go)."""
    if max(lengths) < LONG_TOKENS:
        return ()
    runs, at, run = [], 0, []  # runs: (start, stop, lengths) in row order
    for n in lengths:
        if n >= LONG_TOKENS:
            if run:
                runs.append((at - sum(run), at, tuple(run)))
                run = []
            runs.append((at, at + n, None))
        else:
            run.append(n)
        at += n
    if run:
        runs.append((at - sum(run), at, tuple(run)))
    offsets = [c for _, _, r in runs if r for c in (0, *itertools.accumulate(r))]
    cu = torch.tensor(offsets or [0], dtype=torch.int32).to(device)
    parts, k = [], 0
    for start, stop, r in runs:
        if r is None:
            parts.append((start, stop, _Documents((stop - start,), None, stop - start)))
            continue
        parts.append((start, stop, _Documents(r, cu[k:k + len(r) + 1], max(r))))
        k += len(r) + 1
    return tuple(parts)


def varlen_available(device, dtype) -> bool:
    """Whether the flash kernel runs here: CUDA, half precision (flash attention has no fp32
    kernel), a torch built with it."""
    return (torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and torch.backends.cuda.is_flash_attention_available())


@functools.cache
def _arguments(op) -> frozenset[str]:
    """The argument names an op takes (a torch function or an aten op), read once."""
    schema = getattr(op, "_schema", None)
    if schema is not None:
        return frozenset(a.name for a in schema.arguments)
    return frozenset(inspect.signature(op).parameters)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              sliding_window=None, softcap=None, **_):
    """transformers' attention-interface signature: query (1, Hq, T, D), key/value
    (1, Hkv, T, D[v]); -> ((1, T, Hq, Dv), None)."""
    docs = _CURRENT.get()
    if docs is None:
        raise RuntimeError(f"attention implementation {NAME!r} called outside "
                           "packed_attention.documents(...): it does not know where samples start")
    if query.shape[0] != 1 or query.shape[2] != sum(docs.lengths):
        raise RuntimeError(f"{NAME}: expected one flat row of {sum(docs.lengths)} tokens, got "
                           f"query {tuple(query.shape)}")
    if softcap:
        raise DraftsmithError(
            f"{type(module).__name__} caps its attention logits (softcap), which the packed "
            "varlen attention does not do", "set hidden.attention: flex_attention")
    kernel = KERNEL
    if kernel == "auto":
        kernel = "split" if varlen_available(query.device, query.dtype) else "sdpa"
    run = {"split": _split, "flash": _flash, "varlen": _varlen,
           "sdpa": _sdpa_per_sample}[kernel]
    out = run(query[0], key[0], value[0], docs, scaling, sliding_window)  # (T, Hq, Dv)
    return out.unsqueeze(0), None


def _aten_flash():
    return torch.ops.aten._flash_attention_forward.default


def _flash(q, k, v, docs: _Documents, scale, window):
    """q: (Hq, T, D), k/v: (Hkv, T, D[v]) -> (T, Hq, Dv) through aten's flash attention forward:
    GQA natively (Hq a multiple of Hkv), any row and head strides (only the last dim must be
    contiguous), so the model's tensors go in as views, uncopied."""
    op = _aten_flash()
    d, dv = q.shape[-1], v.shape[-1]
    if dv != d:  # MLA: values narrower than queries; flash wants one head size
        v = F.pad(v, (0, d - dv))
    kw = {"scale": scale}
    if window is not None:
        if "window_size_left" not in _arguments(op):
            raise DraftsmithError(
                f"this torch ({torch.__version__}) has no sliding-window flash attention",
                "set hidden.attention: flex_attention, or upgrade torch")
        kw.update(window_size_left=window - 1, window_size_right=0)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (T, H, D) views
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = op(q, k, v, docs.cu, docs.cu, docs.longest, docs.longest, 0.0, True, False, **kw)[0]
    return out[..., :dv]


def _varlen(q, k, v, docs: _Documents, scale, window):
    """q: (Hq, T, D), k/v: (Hkv, T, D[v]) -> (T, Hq, Dv) through torch's varlen flash kernel,
    whichever of its signatures this torch has (2.9-2.12: is_causal and no GQA; later:
    window_size, scale and enable_gqa)."""
    from torch.nn.attention.varlen import varlen_attn

    takes = _arguments(varlen_attn)
    hq, d, dv = q.shape[0], q.shape[-1], v.shape[-1]
    if dv != d:  # MLA: values narrower than queries; flash wants one head size
        v = F.pad(v, (0, d - dv))
    kw = {}
    if "window_size" in takes:
        kw["window_size"] = (-1 if window is None else window - 1, 0)  # (-1, 0): causal
    elif window is None:
        kw["is_causal"] = True
    else:
        raise DraftsmithError(
            f"this torch ({torch.__version__}) has no sliding-window varlen attention",
            "set hidden.attention: flex_attention, or use torch >= 2.13")
    if scale is not None and "scale" in takes:
        kw["scale"] = scale
    elif scale is not None:
        q = q * (scale * d ** 0.5)  # the kernel's own scale is 1/sqrt(d)
    if k.shape[0] != hq:
        if "enable_gqa" in takes:
            kw["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(hq // t.shape[0], 0) for t in (k, v))
    q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # (T, H, D)
    out = varlen_attn(q, k, v, docs.cu, docs.cu, docs.longest, docs.longest, **kw)
    return out[..., :dv]


def _split(q, k, v, docs: _Documents, scale, window):
    """q: (Hq, T, D), k/v: (Hkv, T, D[v]) -> (T, Hq, Dv): samples of LONG_TOKENS or more
    through SDPA alone (its kernel is faster on long causal sequences), each run of shorter
    ones between them through one flash call on that slice of the row."""
    if not docs.parts:
        return _flash(q, k, v, docs, scale, window)
    out = q.new_empty(q.shape[1], q.shape[0], v.shape[-1])
    for start, stop, part in docs.parts:
        s = slice(start, stop)
        alone = part.cu is None
        out[s] = (_sdpa_per_sample if alone else _flash)(q[:, s], k[:, s], v[:, s], part,
                                                         scale, window)
    return out


def _sdpa_per_sample(q, k, v, docs: _Documents, scale, window):
    """q: (Hq, T, D), k/v: (Hkv, T, D[v]) -> (T, Hq, Dv), one SDPA call per sample."""
    out = q.new_empty(q.shape[1], q.shape[0], v.shape[-1])
    at = 0
    for n in docs.lengths:
        s = slice(at, at + n)
        mask = None
        if window is not None and n > window:  # sliding window: key within `window` behind
            i = torch.arange(n, device=q.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        # batched (1, H, n, D): the layout SDPA's fused GPU kernels take
        o = F.scaled_dot_product_attention(q[None, :, s], k[None, :, s], v[None, :, s],
                                           attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=k.shape[0] != q.shape[0])
        out[s] = o[0].transpose(0, 1)
        at += n
    return out


def _no_mask(*args, **kwargs):
    """The mask function for NAME: the attention itself keeps samples apart."""
    return None


def register() -> str:
    """Make NAME a transformers attention implementation (idempotent); -> NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME
