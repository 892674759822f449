"""The EAGLE-3 drafter, readable in one sitting.

    aux states of 3 target layers --fc--> h (H)            token embedding e (H, frozen, target's)
                 [input_layernorm(e) ; hidden_norm(h)]  (2H)  -> one Llama decoder layer
                 -> prenorm output (H) -> norm -> lm_head over the draft vocab (Vd)

The layer's attention takes the 2H concatenation for q/k/v; its residual is h (pre-norm), as
in vLLM's `llama_eagle3.py`. The prenorm output is the next draft step's `h`. The attention is
grouped-query (`arch: llama`, vLLM's `LlamaForCausalLMEagle3`) or multi-head latent attention
(`arch: mla`, vLLM's `Eagle3DeepseekV2ForCausalLM`: DeepSeek-V3's and Kimi-K2's own attention,
the rest of the layer the same).

Training-time test (TTT) unrolls `steps` draft steps for every position at once. Chain t at
step j sits at rotary position t + j, and its query attends to the step-0 keys at positions
<= t plus its own chain's keys of steps 1..j: exactly what the chain sees at inference, where
step 0 is the prefill over target hidden states and each later step appends one key.
`chain_logits` below is that inference path, and the tests hold the two to each other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DrafterConfig:
    hidden_size: int  # = the target's: the embedding table is shared
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocab
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # vLLM convention: id k = hidden state entering target layer k
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    arch: str = "llama"  # llama: GQA (num_kv_heads, head_dim); mla: the fields below
    q_lora_rank: int | None = None  # MLA: None = one q_proj, no low-rank query
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        if self.arch not in ("llama", "mla"):
            raise ValueError(f"drafter arch {self.arch!r}: llama or mla")
        if self.arch == "mla" and not (self.kv_lora_rank and self.qk_rope_head_dim
                                       and self.v_head_dim):
            raise ValueError("an MLA drafter needs kv_lora_rank, qk_rope_head_dim, v_head_dim")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        return d


def _accum(dtype):
    """Norms and softmax run in at least fp32 (bf16 training), in fp64 for exact tests."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(_accum(dtype))
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
    """An attention whose projections read the 2H input [embedding ; hidden state]; its
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
    """Grouped-query attention (Llama)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(self, x, pos):
        """x: (B, T, 2H) -> q (B, nh, T, hd), k and v (B, nkv, T, hd): grouped-query heads are
        not repeated here; attention broadcasts them."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), pos)

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
        return rotate(q, pos, c.rope_theta), rotate(k, pos, c.rope_theta), v


class MLAttention(_TwoHalfInput):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), with vLLM's weight names.

    The 2H input goes through two low-rank projections: q_a (q_lora_rank) and kv_a (the
    compressed kv_lora_rank latent plus one qk_rope_head_dim key shared by every head). Each is
    normed; q_b and kv_b expand them per head. A head's key is [k_nope ; k_rope] and its query
    [q_nope ; q_rope], rotary on the rope parts only (adjacent pairs). The heads come out as
    ordinary multi-head q, k, v (v narrower than q and k), so the TTT attention and its fast
    path run unchanged; an engine keeps only the latent and the rope key per token."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        n, qk = c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(2 * c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, n * qk, bias=False)
        else:
            self.q_proj = nn.Linear(2 * c.hidden_size, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * c.hidden_size,
                                            c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
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


def repeat_kv(x, num_heads: int):
    """(B, nkv, T, hd) -> (B, nh, T, hd): the reference paths' copy of grouped K/V heads."""
    return x.repeat_interleave(num_heads // x.shape[1], 1)


def ttt_attention(q, k0, v0, ks: list, vs: list, doc=None):
    """The reference TTT attention (dense scores; the fast path in ttt_flex.py is held to it).

    q: (B, nh, T, hd) for chain positions t; k0/v0: step-0 keys (B, nkv, T, hd), attended
    causally (s <= t) within t's document; ks/vs: the chain's own keys of steps 1..j, each
    (B, nkv, T, hd), attended only at the same t (the "diagonal"). doc: (B, T) document index
    of each token in a packed row (-1 for padding), None for one document per row.
    Memory is O(T^2) for step 0 plus O(T * j): the chain keys are never materialised as T x T."""
    T, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    nh = q.shape[1]
    k0, v0 = repeat_kv(k0, nh), repeat_kv(v0, nh)
    ks, vs = [repeat_kv(k, nh) for k in ks], [repeat_kv(v, nh) for v in vs]
    s0 = (q @ k0.transpose(-1, -2)) * scale  # (B, nh, T, T)
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if doc is not None:
        allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
    s0 = s0.masked_fill(~allowed, float("-inf"))
    sd = [(q * k).sum(-1, keepdim=True) * scale for k in ks]  # each (B, nh, T, 1)
    p = torch.softmax(torch.cat([s0, *sd], -1).to(_accum(q.dtype)), -1).to(q.dtype)
    out = p[..., :T] @ v0
    for i, v in enumerate(vs):
        out = out + p[..., T + i: T + i + 1] * v
    return out  # (B, nh, T, hd)


class MidLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAttention(c) if c.arch == "mla" else Attention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def inputs(self, emb, h):
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)

    def finish(self, attn, h):
        """attention output (B, nh, T, hd_v) + residual h -> the layer's prenorm output."""
        B, nh, T, hd = attn.shape
        h = h + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, nh * hd))
        return h + self.mlp(self.post_attention_layernorm(h))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Drafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def logits(self, prenorm):
        return self.lm_head(self.norm(prenorm))

    def forward(self, aux, next_ids, steps: int, doc=None, pos=None):
        """Training-time test on the reference attention: per-step draft-vocab logits, each
        (B, T, Vd). Arguments as for `unroll`."""
        return [self.logits(h) for h in self.unroll(aux, next_ids, steps, doc=doc, pos=pos)]

    def unroll(self, aux, next_ids, steps: int, *, doc=None, pos=None, attend=None):
        """Training-time test: every position's chain, `steps` draft steps deep.

        aux: (B, T, 3*Ht) target aux states at positions t; next_ids: (B, T + steps) where
        next_ids[:, t + j] is the token fed to chain t at step j (the token after t, then the
        ones after it); doc: (B, T) document index per token of a packed row (None: one
        document); pos: (B, T) position of each token in its document (None: 0..T-1);
        attend(q, k0, v0, ks, vs): the TTT attention (default: the dense reference under
        `doc`). Returns the per-step prenorm states (B, T, H): `logits(h)` gives the drafts."""
        B, T, _ = aux.shape
        if pos is None:
            pos = torch.arange(T, device=aux.device)
        if attend is None:
            def attend(q, k0, v0, ks, vs):
                return ttt_attention(q, k0, v0, ks, vs, doc)
        h = self.fc(aux)
        # Chain t's token at step j is chain t+j's token at step 0: the embedding half of the
        # q/k/v projection is the same for every step, shifted. Project it once.
        emb = self.midlayer.input_layernorm(self.embed_tokens(next_ids[:, :T + steps - 1]))
        w_emb, w_hidden = self.midlayer.self_attn.stacked_halves()
        emb_qkv = F.linear(emb, w_emb)
        k0 = v0 = None
        ks, vs, out = [], [], []
        for j in range(steps):
            q, k, v = self.step_qkv(emb_qkv[:, j: j + T], h, pos + j, w_hidden)
            if j == 0:
                k0, v0 = k, v
            else:
                ks.append(k)
                vs.append(v)
            h = self.midlayer.finish(attend(q, k0, v0, ks, vs), h)
            out.append(h)
        return out

    def step_qkv(self, emb_qkv, h, pos, w_hidden):
        """One draft step's attention inputs: the projected embedding half plus the projected
        norm(h) half (`stacked_halves`), rotated."""
        attn = self.midlayer.self_attn
        return attn.split_heads(emb_qkv + F.linear(self.midlayer.hidden_norm(h), w_hidden), pos)

    @torch.no_grad()
    def chain(self, aux, tokens, steps: int, next_token, cache: DrafterCache | None = None):
        """Inference path for one sequence (B = 1), as an engine runs it. aux (1, m, 3Ht): the
        target's aux states at the m positions after those already in `cache` (a fresh cache:
        the whole prefix), each paired with tokens[:, i] (the token after that position).
        Step 0 appends their keys to the cache and reads it from the last position; then
        `steps - 1` chained steps follow, each attending to the cache plus the chain's own
        keys. After step j's logits, next_token(j, logits) gives the target-vocab token (a
        0-d tensor) fed to step j + 1. Returns the list of (Vd,) logits, one per step."""
        cache = cache if cache is not None else DrafterCache()
        attn = self.midlayer.self_attn
        start, n = cache.length, cache.length + aux.shape[1]
        h = self.fc(aux)
        q, k, v = attn.qkv(self.midlayer.inputs(self.embed_tokens(tokens), h),
                           torch.arange(start, n, device=aux.device))
        keys, values = cache.write(start, k, v)
        cache.length = n
        # A step-0 key depends on its own position's inputs only (one layer), so appending
        # never changes the cached ones; only the last position's output feeds the chain.
        h = self.midlayer.finish(decode_attention(q[:, :, -1:], keys, values), h[:, -1:])
        out = [self.logits(h)[0, -1]]
        for j in range(1, steps):
            tok = next_token(j - 1, out[-1]).view(1, 1)
            q, k, v = attn.qkv(self.midlayer.inputs(self.embed_tokens(tok), h),
                               torch.arange(n - 1 + j, n + j, device=aux.device))
            # Written past the verified length: seen by this chain's later steps, then
            # overwritten by the next round's append.
            keys, values = cache.write(n - 1 + j, k, v)
            h = self.midlayer.finish(decode_attention(q, keys, values), h)
            out.append(self.logits(h)[0, -1])
        return out

    def chain_logits(self, aux, next_ids, steps: int):
        """The chain with teacher-forced tokens, laid out as for `forward`: the reference the
        tests hold the training path to."""
        n = aux.shape[1]
        return self.chain(aux, next_ids[:, :n], steps, lambda j, _: next_ids[0, n + j])

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]


class DrafterCache:
    """One sequence's drafter keys/values (B = 1): the step-0 keys of its `length` verified
    positions, then room where a round's chained steps put theirs. The buffer doubles when
    full, so appending a round's positions never copies the whole prefix."""

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
    """One query position against all of k/v, grouped-query heads not copied: the query heads
    sharing a KV head are the rows of one matmul against it.
    q: (B, nh, 1, hd); k: (B, nkv, S, hd), v: (B, nkv, S, hd_v) -> (B, nh, 1, hd_v)."""
    B, nh, _, hd = q.shape
    q = q.reshape(B, k.shape[1], nh // k.shape[1], hd)  # head i uses KV head i // (nh / nkv)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    p = torch.softmax(scores.to(_accum(q.dtype)), -1).to(q.dtype)
    return (p @ v).view(B, nh, 1, v.shape[-1])
