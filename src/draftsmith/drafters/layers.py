"""What every drafter method is built of: norms, rotary embeddings, the grouped-query (Llama,
Qwen3) and multi-head latent (DeepSeek-V3, Kimi-K2) attentions, the MLP, a KV cache and
single-query decode attention. Weight names are the engines' (vLLM's llama_eagle3.py,
deepseek_eagle3.py, qwen3_dflash.py), so an export is these modules' state dict.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.drafters.base import DrafterConfig


def accum(dtype):
    """Norms and softmax run in at least fp32 (bf16 training), in fp64 for exact tests."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(accum(dtype))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotary_angles(x, pos, theta: float):
    """cos and sin of the rotary angles for x: (..., T, hd), pos: (T,) or (B, T) ->
    (..., T, hd/2), with a head axis added for a per-row pos to broadcast over heads."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.to(torch.float32)[..., None] * inv
    if ang.dim() == 3:  # (B, T, hd/2) -> (B, 1, T, hd/2)
        ang = ang[:, None]
    return ang.cos(), ang.sin()


def rotate(x, pos, theta: float):
    """Rotary embedding, Llama/NeoX half-rotation layout. x: (..., T, hd), pos: (T,) or (B, T)."""
    cos, sin = _rotary_angles(x, pos, theta)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    hd = x.shape[-1]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def rotate_pairs(x, pos, theta: float):
    """Rotary embedding on adjacent pairs (x[2i], x[2i+1]): DeepSeek's MLA layout, what vLLM's
    rope does with is_neox_style=False. Arguments as for `rotate`."""
    cos, sin = _rotary_angles(x, pos, theta)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2) \
        .to(x.dtype)


class _TwoHalfInput(nn.Module):
    """An attention whose projections read EAGLE-3's 2H input [embedding ; hidden state]; its
    `input_weight()` is every such projection's weight, stacked."""

    def stacked_halves(self):
        """`input_weight` cut into the columns that read the embedding half and those that
        read the hidden half: [W_e | W_h] @ [e; h] = W_e @ e + W_h @ h, so the halves can be
        projected apart. Training takes them once per unroll: autograd then sums W_h's
        gradient over the TTT steps before one copy into the weights (a slice per step made a
        full-size gradient per step), and each projection is one GEMM instead of several."""
        w = self.input_weight()
        return w[:, :self.c.hidden_size], w[:, self.c.hidden_size:]


class Attention(_TwoHalfInput):
    """Grouped-query attention (Llama; with `qk_norm`, Qwen3's per-head RMSNorm of queries and
    keys before rotary). `in_features`: what q/k/v read (EAGLE-3: 2H, DFlash: H)."""

    def __init__(self, c: DrafterConfig, in_features: int, qk_norm: bool = False):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(in_features, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def qkv(self, x, pos):
        """x: (B, T, in) -> q (B, nh, T, hd), k and v (B, nkv, T, hd): grouped-query heads are
        not repeated here; attention broadcasts them."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), pos)

    def kv(self, x, pos):
        """Keys and values alone (DFlash's context): x (B, T, in) -> (B, nkv, T, hd) each."""
        B, T, _ = x.shape
        c = self.c
        k = self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return self._rope(self._norm("k_norm", k), pos), v

    def input_weight(self):
        return torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])

    def split_heads(self, qkv, pos):
        """A stacked projection (B, T, (nh + 2 nkv) * hd) -> rotated q, k, v as `heads`."""
        c = self.c
        return self.heads(*qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                      c.num_kv_heads * c.head_dim], -1), pos)

    def heads(self, q, k, v, pos):
        """Projected (B, T, n * hd) -> per-head q, k, v with rotary positions applied."""
        B, T, _ = q.shape
        c = self.c
        q = q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return (self._rope(self._norm("q_norm", q), pos), self._rope(self._norm("k_norm", k), pos),
                v)

    def _norm(self, name, x):
        norm = getattr(self, name, None)
        return x if norm is None else norm(x)

    def _rope(self, x, pos):
        return rotate(x, pos, self.c.rope_theta)


class MLAttention(_TwoHalfInput):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), with vLLM's weight names.

    The 2H input goes through two low-rank projections: q_a (q_lora_rank) and kv_a (the
    compressed kv_lora_rank latent plus one qk_rope_head_dim key shared by every head). Each is
    normed; q_b and kv_b expand them per head. A head's key is [k_nope ; k_rope] and its query
    [q_nope ; q_rope], rotary on the rope parts only (adjacent pairs). The heads come out as
    ordinary multi-head q, k, v (v narrower than q and k), so the TTT attention and its fast
    path run unchanged; an engine keeps only the latent and the rope key per token."""

    def __init__(self, c: DrafterConfig, in_features: int):
        super().__init__()
        self.c = c
        n, qk = c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(in_features, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, n * qk, bias=False)
        else:
            self.q_proj = nn.Linear(in_features, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_features, c.kv_lora_rank + c.qk_rope_head_dim,
                                            bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(n * c.v_head_dim, c.hidden_size, bias=False)

    def qkv(self, x, pos):
        return self.split_heads(F.linear(x, self.input_weight()), pos)

    def input_weight(self):
        q = self.q_a_proj if self.c.q_lora_rank else self.q_proj
        return torch.cat([q.weight, self.kv_a_proj_with_mqa.weight])

    def split_heads(self, proj, pos):
        """(B, T, q_a + kv_a widths) -> q, k (B, n, T, nope + rope), v (B, n, T, v_head_dim)."""
        c = self.c
        B, T, _ = proj.shape
        n, nope, rope = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        q, kv_a = proj.split([proj.shape[-1] - c.kv_lora_rank - rope, c.kv_lora_rank + rope], -1)
        if c.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(B, T, n, nope + rope).transpose(1, 2)
        latent, k_rope = kv_a.split([c.kv_lora_rank, rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, n, nope + c.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([nope, c.v_head_dim], -1)
        q_nope, q_rope = q.split([nope, rope], -1)
        q = torch.cat([q_nope, rotate_pairs(q_rope, pos, c.rope_theta)], -1)
        k_rope = rotate_pairs(k_rope[:, None], pos, c.rope_theta).expand(B, n, T, rope)
        return q, torch.cat([k_nope, k_rope], -1), v


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(x, num_heads: int):
    """(B, nkv, T, hd) -> (B, nh, T, hd): the reference paths' copy of grouped K/V heads."""
    return x.repeat_interleave(num_heads // x.shape[1], 1)


class KVCache:
    """One sequence's keys and values (B = 1) of one attention, at slots 0.. of its positions.
    The buffer doubles when full, so appending a round's positions never copies the whole
    prefix."""

    def __init__(self):
        self.keys = self.values = None  # (1, nkv, capacity, hd), values' hd_v (MLA: narrower)
        self.length = 0

    def write(self, at: int, k, v):
        """Store k, v (1, nkv, T, hd or MLA's narrower hd_v) at slots at..at+T-1; -> keys
        and values of slots < at+T."""
        end = at + k.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            shape = (*k.shape[:2], max(64, 2 * end))
            keys, values = k.new_empty(*shape, k.shape[3]), v.new_empty(*shape, v.shape[3])
            if self.keys is not None:
                keys[:, :, :at], values[:, :, :at] = self.keys[:, :, :at], self.values[:, :, :at]
            self.keys, self.values = keys, values
        self.keys[:, :, at:end], self.values[:, :, at:end] = k, v
        return self.keys[:, :, :end], self.values[:, :, :end]


def decode_attention(q, k, v):
    """Query positions that see every key (no mask), grouped-query heads not copied: the query
    heads sharing a KV head are the rows of one matmul against it.
    q: (B, nh, Tq, hd); k: (B, nkv, S, hd), v: (B, nkv, S, hd_v) -> (B, nh, Tq, hd_v)."""
    B, nh, Tq, hd = q.shape
    nkv = k.shape[1]
    q = q.reshape(B, nkv, nh // nkv * Tq, hd)  # head i uses KV head i // (nh / nkv)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    p = torch.softmax(scores.to(accum(q.dtype)), -1).to(q.dtype)
    return (p @ v).view(B, nh, Tq, v.shape[-1])
