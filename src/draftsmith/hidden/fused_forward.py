"""The target's elementwise work fused, for the hidden stage's forward on a GPU.

transformers' eager RMSNorm is seven kernels over fp32 copies of its input (cast, pow, mean,
add, rsqrt, mul, cast back, mul by the weight), SiLU-and-mul two, rotary six per tensor. On an
H200 with Qwen3-8B's shape (four norms a layer: q and k have their own) those kernels and their
casts took 0.20 s of the equal-length forward's 0.50 s GPU time against 0.30 s of GEMMs
(benchmarks/results/profile_hidden_equal_qwen3_h200.txt), holding the model at 0.57 MFU.
Compiled, each is one kernel that reads its inputs once and writes once.

Nothing here is guessed from a class name: a norm, an MLP or a modeling module's rotary function
is swapped only when the fused expression, run eagerly, gives exactly the original's output on a
probe input. A family whose norm differs (Gemma's `1 + weight`, say) or whose MLP is gated
otherwise keeps its own code, and the rest of the model is fused around it.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama, Qwen2/3, Mistral, DeepSeek...), the same expression."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rotary(q, k, cos, sin, unsqueeze_dim: int = 1):
    """transformers' `apply_rotary_pos_emb` (half-split rotation), the same expression."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


@functools.cache
def _compiled(fn):
    # dynamic: one kernel for every row length, not one compile per shape
    return torch.compile(fn, dynamic=True)


def can_compile(device: torch.device) -> bool:
    if device.type != "cuda":
        return False  # measured on GPUs only: a CPU keeps transformers' forward
    from torch.utils._triton import has_triton

    return has_triton()


@contextlib.contextmanager
def fused(model, eager: bool = False):
    """Inside, the model's norms, SiLU-MLPs and rotary run as compiled, fused kernels on a GPU
    with Triton (nothing changes elsewhere). eager: swap in the same expressions uncompiled, on
    any device (the tests check the swap on a CPU). Yields what was swapped, e.g. {"rms_norm":
    145, "silu_mul": 36, "rotary": 1}; everything is put back on exit."""
    if not eager and not can_compile(model.device):
        yield {}
        return
    pick = (lambda fn: fn) if eager else _compiled
    undo, counts = [], {}

    def swap(owner, name, new, kind):
        old = owner.__dict__.get(name, _MISSING)
        setattr(owner, name, new)
        undo.append((owner, name, old))
        counts[kind] = counts.get(kind, 0) + 1

    try:
        homes = set()  # modeling modules looked at for a rotary function
        for module in model.modules():
            if _is_rms_norm(module):
                norm, weight, eps = pick(rms_norm), module.weight, _eps(module)
                swap(module, "forward", lambda x, n=norm, w=weight, e=eps: n(x, w, e), "rms_norm")
            elif _is_silu_mlp(module):
                act, m = pick(silu_mul), module
                swap(module, "forward",
                     lambda x, a=act, m=m: m.down_proj(a(m.gate_proj(x), m.up_proj(x))),
                     "silu_mul")
            home = sys.modules.get(type(module).__module__)
            if home is not None and home not in homes:
                homes.add(home)
                if _has_rotary(home):
                    swap(home, "apply_rotary_pos_emb", pick(rotary), "rotary")
        yield counts
    finally:
        for owner, name, old in reversed(undo):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


_MISSING = object()


def _eps(module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if isinstance(eps, float) else None


@torch.no_grad()
def _is_rms_norm(module) -> bool:
    weight, eps = getattr(module, "weight", None), _eps(module)
    if not type(module).__name__.endswith("RMSNorm") or eps is None \
            or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return False
    x = torch.randn(3, weight.shape[0], device=weight.device).to(weight.dtype)
    return torch.equal(module(x), rms_norm(x, weight, eps))


@torch.no_grad()
def _is_silu_mlp(module) -> bool:
    parts = [getattr(module, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, torch.nn.Linear) for p in parts) or not callable(
            getattr(module, "act_fn", None)):
        return False
    gate, up, down = parts
    x = torch.randn(2, gate.in_features, device=gate.weight.device).to(gate.weight.dtype)
    return torch.equal(module(x), down(silu_mul(gate(x), up(x))))


def _has_rotary(home) -> bool:
    original = getattr(home, "apply_rotary_pos_emb", None)
    if not callable(original):
        return False
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 1, 3, 8, generator=g)
    cos, sin = torch.randn(1, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    try:
        want = original(q, k, cos, sin)
    except Exception:  # another signature (MLA's interleaved rope, say): not this function
        return False
    got = rotary(q, k, cos, sin)
    return all(torch.equal(a, b) for a, b in zip(want, got))
