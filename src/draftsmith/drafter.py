"""The EAGLE-3 drafter, readable in one sitting.

    aux states of 3 target layers --fc--> h (H)            token embedding e (H, frozen, target's)
                 [input_layernorm(e) ; hidden_norm(h)]  (2H)  -> one Llama decoder layer
                 -> prenorm output (H) -> norm -> lm_head over the draft vocab (Vd)

The layer's attention takes the 2H concatenation for q/k/v; its residual is h (pre-norm), as
in vLLM's `llama_eagle3.py`. The prenorm output is the next draft step's `h`.

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


def rotate(x, pos, theta: float):
    """Rotary embedding, Llama/NeoX half-rotation layout. x: (..., T, hd), pos: (T,) or (B, T)."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.to(torch.float32)[..., None] * inv  # (..., T, hd/2)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    if cos.dim() == 3:  # (B, T, hd) -> (B, 1, T, hd) to broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(self, x, pos):
        """x: (B, T, 2H) -> q (B, nh, T, hd), k and v (B, nh, T, hd) (kv heads repeated)."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return rotate(q, pos, c.rope_theta), rotate(k, pos, c.rope_theta), v


def ttt_attention(q, k0, v0, ks: list, vs: list, key_mask=None):
    """q: (B, nh, T, hd) for chain positions t; k0/v0: step-0 keys (B, nh, T, hd), attended
    causally (s <= t); ks/vs: the chain's own keys of steps 1..j, each (B, nh, T, hd),
    attended only at the same t (the "diagonal"). key_mask: (B, T) True for real tokens.
    Memory is O(T^2) for step 0 plus O(T * j): the chain keys are never materialised as T x T."""
    T, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    s0 = (q @ k0.transpose(-1, -2)) * scale  # (B, nh, T, T)
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
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
        self.self_attn = Attention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def inputs(self, emb, h):
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)

    def finish(self, attn, h):
        """attention output (B, nh, T, hd) + residual h -> the layer's prenorm output."""
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

    def forward(self, aux, next_ids, steps: int, key_mask=None):
        """Training-time test.

        aux: (B, T, 3*Ht) target aux states at positions t; next_ids: (B, T + steps) where
        next_ids[:, t + j] is the token fed to chain t at step j (the token after t, then the
        ones after it); key_mask: (B, T). Returns per-step draft-vocab logits, each (B, T, Vd)."""
        B, T, _ = aux.shape
        pos = torch.arange(T, device=aux.device)
        h = self.fc(aux)
        attn = self.midlayer.self_attn
        k0 = v0 = None
        ks, vs, out = [], [], []
        for j in range(steps):
            x = self.midlayer.inputs(self.embed_tokens(next_ids[:, j: j + T]), h)
            q, k, v = attn.qkv(x, pos + j)
            if j == 0:
                k0, v0 = k, v
            else:
                ks.append(k)
                vs.append(v)
            h = self.midlayer.finish(ttt_attention(q, k0, v0, ks, vs, key_mask), h)
            out.append(self.logits(h))
        return out

    @torch.no_grad()
    def chain(self, aux, tokens, steps: int, next_token):
        """Inference path for one sequence (B = 1), as an engine runs it: prefill over the n
        positions of aux (1, n, 3Ht), each paired with tokens[:, i] (the token after position
        i), then `steps` chained steps from the last position. After step j's logits,
        next_token(j, logits) gives the target-vocab token fed to step j + 1.
        Returns the list of (Vd,) logits, one per step."""
        n = aux.shape[1]
        attn = self.midlayer.self_attn
        h = self.fc(aux)
        x = self.midlayer.inputs(self.embed_tokens(tokens), h)
        q, k0, v0 = attn.qkv(x, torch.arange(n))
        h = self.midlayer.finish(ttt_attention(q, k0, v0, [], []), h)[:, -1:]
        out = [self.logits(h)[0, -1]]
        ks, vs = [], []
        for j in range(1, steps):
            tok = torch.tensor([[next_token(j - 1, out[-1])]])
            q, k, v = attn.qkv(self.midlayer.inputs(self.embed_tokens(tok), h),
                               torch.tensor([n - 1 + j]))
            ks.append(k)
            vs.append(v)
            # The chain's query sees all n prefill keys plus its own keys (one position each).
            keys, vals = torch.cat([k0, *ks], 2), torch.cat([v0, *vs], 2)
            p = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
            h = self.midlayer.finish(p @ vals, h)
            out.append(self.logits(h)[0, -1])
        return out

    def chain_logits(self, aux, next_ids, steps: int):
        """The chain with teacher-forced tokens, laid out as for `forward`: the reference the
        tests hold the training path to."""
        n = aux.shape[1]
        return self.chain(aux, next_ids[:, :n], steps, lambda j, _: int(next_ids[0, n + j]))

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]
