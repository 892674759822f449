"""Is an engine's speculative output the target's own? Speculative decoding promises that it is:
token for token at T=0, in distribution at T>0. Acceptance says nothing about it (an engine can
accept drafts and emit garbage), so the benchmark checks the outputs themselves.

- T=0: the outputs must be identical to the target's own greedy outputs.
- T>0: a goodness-of-fit test of the outputs under the target itself. At each generated
  position the target (fed the prompt and the tokens before it, as generated) gives its
  tempered distribution p. For the token x the engine emitted there, the randomised
  probability integral transform
      u = (mass of the tokens p ranks above x) + V * p(x),   V ~ U(0, 1)
  is uniform on (0, 1), independently across positions, exactly when every token is drawn from
  p (Rosenblatt, 1952). One Kolmogorov-Smirnov test of all the u's against U(0, 1) then checks
  the whole output distribution: with n tokens it detects a gap of 1.63/sqrt(n) between the
  CDFs at the 1% level (0.023 at n = 5,000). An engine emitting tokens the target finds
  unlikely piles its u's up near 1.
"""

from __future__ import annotations

import math

import torch

ALPHA = 0.01  # the test's false-alarm rate: a lossless engine is flagged 1 run in 100


@torch.no_grad()
def pit_values(model, prompt_ids: list[list[int]], output_ids: list[list[int]],
               temperature: float, seed: int = 0) -> torch.Tensor:
    """The randomised PIT value of every output token under `model` at `temperature`."""
    gen = torch.Generator().manual_seed(seed)
    values = []
    for prompt, out in zip(prompt_ids, output_ids):
        if not out:
            continue
        ids = torch.tensor([prompt + out], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1:-1].double().cpu()  # rows predict `out`
        p = torch.softmax(logits / temperature, -1)
        chosen = p.gather(1, torch.tensor(out).view(-1, 1)).squeeze(1)
        above = torch.where(p > chosen[:, None], p, torch.zeros_like(p)).sum(1)
        values.append(above + torch.rand(len(out), generator=gen, dtype=torch.double) * chosen)
    return torch.cat(values) if values else torch.empty(0, dtype=torch.double)


def ks_uniform(u: torch.Tensor) -> tuple[float, float]:
    """Kolmogorov-Smirnov statistic of u against U(0, 1) and its asymptotic p-value
    (Stephens' small-sample correction)."""
    n = len(u)
    s = torch.sort(u.clamp(0, 1)).values
    i = torch.arange(1, n + 1, dtype=torch.double)
    d = float(torch.maximum(i / n - s, s - (i - 1) / n).max())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101))
    return d, min(1.0, max(0.0, p))


def check_sampled(model, prompt_ids, output_ids, temperature: float, seed: int = 0,
                  alpha: float = ALPHA) -> dict:
    """The T>0 verdict on one engine's outputs, with its evidence."""
    u = pit_values(model, prompt_ids, output_ids, temperature, seed)
    if len(u) < 100:
        return {"lossless": None, "test": "pit-ks", "tokens": len(u),
                "reason": "fewer than 100 output tokens: too few to test"}
    d, p = ks_uniform(u)
    tail = float((u > 0.99).double().mean())
    return {"lossless": p >= alpha, "test": "pit-ks", "tokens": len(u), "ks_statistic": round(d, 4),
            "p_value": float(f"{p:.3g}"), "alpha": alpha,
            # expected 0.01 under the target: the share of tokens the target finds unlikely
            "share_in_target_tail_1pct": round(tail, 4),
            "detectable_cdf_gap": round(1.63 / math.sqrt(len(u)), 4)}


def tie_tolerance(dtype: torch.dtype) -> float:
    """How close, relative, two logits are when they tie for the target's dtype: 1e-3 (fp32,
    where engines differ only in summation order), or one rounding step of a lower dtype (bf16:
    2^-7 of the logit). Two bf16 logits one step apart are neighbouring bf16 numbers: below what
    the target computes in, either engine's order of summation picks either token."""
    return max(1e-3, torch.finfo(dtype).eps)


@torch.no_grad()
def check_greedy(model, prompt_ids: list[list[int]], reference: list[list[int]],
                 outputs: list[list[int]], tie: float | None = None) -> dict:
    """The T=0 verdict: every output identical to the target's own greedy one, except where
    the two part at a tie (the target's logits for both tokens within `tie`, relative; default
    `tie_tolerance` of the model's dtype): there the engine's numerics, not its speculation,
    picked the other token."""
    tie = tie_tolerance(model.dtype) if tie is None else tie
    same = ties = 0
    first_bad = None
    gaps = []  # where a differing output parts from the target's: the logit gap, relative
    for i, (prompt, ref, out) in enumerate(zip(prompt_ids, reference, outputs)):
        if ref == out:
            same += 1
            continue
        n = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        if n < min(len(ref), len(out)):
            logits = model(torch.tensor([prompt + ref[:n]], device=model.device)).logits[0, -1]
            gap = float(logits[ref[n]] - logits[out[n]])
            scale = max(1.0, float(logits[ref[n]].abs()))
            gaps.append({"prompt": i, "position": n, "relative_gap": round(abs(gap) / scale, 6)})
            if abs(gap) <= tie * scale:
                ties += 1
                continue
        first_bad = first_bad if first_bad is not None else i
    out = {"lossless": same + ties == len(reference), "test": "identical to the target alone",
           "identical": same, "parted_at_a_tie": ties, "outputs": len(reference),
           "tie": tie, "partings": gaps}
    if first_bad is not None:
        out["first_different_prompt"] = first_bad
    return out
