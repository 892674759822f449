"""The TTT attention without T x T tensors: flex_attention over the step-0 keys, merged with the
chain's own (diagonal) keys through the log-sum-exp.

Chain t at step j attends to the step-0 keys s <= t of its own document, and to its own keys
of steps 1..j (one per step, at the same t). Split the softmax over those two key sets:

    out = (exp(lse0) * o0 + sum_i exp(s_i) * v_i) / (exp(lse0) + sum_i exp(s_i))

where (o0, lse0) is block-sparse flex_attention over the step-0 keys (causal + document mask:
fully masked blocks are skipped, so packing costs no compute across documents) and
s_i = q . k_i / sqrt(hd) is a per-position dot product. Every step calls flex_attention with the
same shapes and the same block mask (built once per batch), so it compiles once; the diagonal
part is O(T * j). Grouped-query heads are broadcast, never copied. `drafter.ttt_attention` is
the dense reference the tests hold this to (gradients flow through lse0 too).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from draftsmith.drafters.ttt_kernels import allow_recompiles, diagonal_merge

try:  # torch >= 2.9 returns the log-sum-exp this way; older versions through return_lse
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:
    AuxRequest = None

_compiled = None


def _flex():
    """flex_attention compiled once per process on CUDA (the eager version materialises the
    scores: right on small CPU inputs, but O(T^2) memory)."""
    global _compiled
    if _compiled is None:
        allow_recompiles()
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def document_block_mask(doc: torch.Tensor, num_heads: int | None = None):
    """Causal + same-document block mask for packed rows. doc: (B, T) document index per
    token, -1 on padding (padding attends to padding, so no row is empty)."""
    B, T = doc.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    return create_block_mask(mask_mod, B, None, T, T, device=doc.device,
                             _compile=doc.is_cuda)


def _with_lse(attn, q, k, v, block_mask):
    """-> (out, lse) from flex_attention, in the API of the installed torch."""
    gqa = k.shape[1] != q.shape[1]
    if AuxRequest is None:
        return attn(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_lse=True)
    out, aux = attn(q, k, v, block_mask=block_mask, enable_gqa=gqa,
                    return_aux=AuxRequest(lse=True))
    return out, aux.lse


def ttt_attention_flex(q, k0, v0, ks: list, vs: list, block_mask, valid=None):
    """q: (B, nh, T, hd); k0 and each of ks: (B, nkv, T, hd); v0 and each of vs: (B, nkv,
    T, hd_v); valid: which diagonal keys count (None: all; ttt_kernels.fixed_width). Same
    result as drafter.ttt_attention(q, k0, v0, ks, vs, doc) for the block mask of `doc`."""
    attn = _flex() if q.is_cuda else flex_attention
    o0, lse0 = _with_lse(attn, q, k0, v0, block_mask)
    if not ks:
        return o0
    return diagonal_merge(o0, lse0, q, ks, vs, valid)[0]


class FlexAttention:
    """train.attention flex: ttt_attention_flex, compiled when asked, with the interface of
    ttt_kernels.KernelAttention (`for_documents`). Compiled, it pads every step's diagonal
    keys to the widest (`fixed_width`): each graph holds flex attention's own, which take
    minutes to compile."""

    fixed_width = True

    def __init__(self, compile: bool = False):
        self.attend = compiled_ttt_attention_flex() if compile else ttt_attention_flex

    def for_documents(self, doc):
        """attend(q, k0, v0, ks, vs, valid=None) for a batch of these documents."""
        mask = document_block_mask(doc)
        return lambda q, k0, v0, ks, vs, valid=None: self.attend(  # noqa: E731
            q, k0, v0, ks, vs, mask, valid)


def compiled_ttt_attention_flex():
    """The whole TTT attention compiled (flex + the log-sum-exp merge fused): one graph per
    number of diagonal keys, or one in all under ttt_kernels.fixed_width."""
    _flex()  # raises dynamo's recompile limits first
    return torch.compile(ttt_attention_flex, dynamic=False)
