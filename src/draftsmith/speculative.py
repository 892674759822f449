"""A reference speculative-decoding engine: drafts of k tokens, verified by the target.

Each round: the drafter's method proposes k tokens from the target's aux hidden states
(drafters/: EAGLE-3 as an engine feeds it, step 0 over the newly verified positions, then k - 1
chained steps; DFlash one block over them); one target forward over the drafts verifies them.
Greedy: a draft is accepted while it equals the target's argmax. Sampling: draft x ~ q is accepted with probability
min(1, p(x)/q(x)); on rejection the replacement is drawn from norm(max(0, p - q)); after k
acceptances a bonus token is drawn from p. The output is then distributed exactly as the
target's own sampling (Leviathan et al. 2023), which tests/test_speculative.py checks
statistically.

Both models keep a KV cache across rounds, so each round costs what it would in an engine: the
target runs over the last emitted token + the k drafts, then drops the rejected drafts' keys;
the drafter appends the newly verified positions (their aux states come from that same
verification forward) and drafts again. Everything stays on the target's device;
the host reads tokens only where it decides on them.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from draftsmith.capture import capture
from draftsmith.drafters.base import Proposer, pick


@dataclass
class SpecStats:
    rounds: int = 0  # target forwards that verified drafts
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens produced by verification rounds (accepted + one each round)
    accepted_at: list[int] = field(default_factory=list)  # per draft position
    reached: list[int] = field(default_factory=list)  # rounds whose position i was judged

    def add(self, other: SpecStats) -> None:
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted
        for name in ("accepted_at", "reached"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def summary(self) -> dict:
        k = len(self.reached)
        return {
            # Tokens per target forward, bonus included (vLLM's "mean acceptance length").
            "acceptance_length": round(self.emitted / max(1, self.rounds), 4),
            # Share of drafts at position i accepted, over all rounds (vLLM's per-position rate).
            "acceptance_rate_per_position": [round(a / max(1, self.rounds), 4)
                                             for a in self.accepted_at],
            # ...and conditional on position i being reached (all earlier ones accepted).
            "conditional_acceptance_per_position": [
                round(a / max(1, r), 4) for a, r in zip(self.accepted_at, self.reached)],
            "draft_acceptance_rate": round(self.accepted / max(1, self.drafted), 4),
            "target_forwards_saved": round(1 - self.rounds / max(1, self.emitted), 4),
            "rounds": self.rounds, "k": k,
        }


class TargetProposer(Proposer):
    """The target drafting for itself (a perfect drafter at greedy: acceptance k + 1)."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def propose(self, aux, ids, k: int, temperature: float, gen: torch.Generator):
        drafts, qs = [], []
        for _ in range(k):
            logits = self.model(input_ids=torch.cat([ids, *drafts])[None]).logits[0, -1]
            tok, q = pick(logits, temperature, gen)
            drafts.append(tok[None])
            if q is not None:
                qs.append(q)
        return torch.cat(drafts), (torch.stack(qs) if qs else None)


@torch.no_grad()
def target_forward(model, ids, aux_layers, cache: DynamicCache):
    """Run the target over `ids` (T,), the tokens after the cache's positions, adding theirs to
    the cache. -> aux (T, 3H) entering `aux_layers` (as `capture.capture`) and the final hidden
    states (T, H)."""
    # transformers 5.x renames `past_key_values` to `cache`; remote code may keep the old name.
    params = inspect.signature(model.get_decoder().forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    aux, final = capture(model, ids[None], None, aux_layers, use_cache=True, **{cache_arg: cache})
    return aux[0], final[0]


def target_logits(model, final):
    return final @ model.get_output_embeddings().weight.T


@torch.no_grad()
def generate(model, proposer, prompt_ids: list[int], *, k: int, aux_layers: list[int],
             max_new_tokens: int, eos_id: int, temperature: float = 0.0,
             gen: torch.Generator | None = None) -> tuple[list[int], SpecStats]:
    """Speculative generation from one prompt, on the target's device (`gen` must be a
    generator of that device). Returns (new tokens, stats)."""
    device = model.device
    gen = gen or torch.Generator(device).manual_seed(0)
    stats = SpecStats(accepted_at=[0] * k, reached=[0] * k)
    cache = DynamicCache(config=model.config)
    seq = torch.tensor(prompt_ids, device=device)
    # Prefill: the first token from the target; the drafter has seen none of the positions.
    new_aux, final = target_forward(model, seq, aux_layers, cache)
    emitted = [int(pick(target_logits(model, final[-1]), temperature, gen)[0])]
    out = list(emitted)
    while out[-1] != eos_id and len(out) < max_new_tokens:
        seq = torch.cat([seq, torch.tensor(emitted, device=device)])
        drafts, q = proposer.propose(new_aux, seq, k, temperature, gen)
        # The cache holds every token but the last emitted one: verify it and the drafts.
        aux, final = target_forward(model, torch.cat([seq[-1:], drafts]), aux_layers, cache)
        emitted = _verify(target_logits(model, final), drafts, q, temperature, gen, eos_id, stats)
        # The positions kept are the last token's and the accepted drafts': as many as emitted.
        if len(emitted) < k + 1:
            cache.crop(-(k + 1 - len(emitted)))
        new_aux = aux[: len(emitted)]
        out += emitted
    if eos_id in out:
        out = out[: out.index(eos_id) + 1]
    return out[:max_new_tokens], stats


def _verify(logits, drafts, q, temperature: float, gen, eos_id: int, stats: SpecStats
            ) -> list[int]:
    """Judge the k drafts against the target's logits (k + 1, V), row i its distribution for
    the token after draft i - 1; -> the tokens the round emits. Random draws are made in the
    same order as a step-by-step loop would, so a generator gives the same output."""
    k = len(drafts)
    stats.rounds += 1
    stats.drafted += k
    if temperature <= 0:
        best = logits.argmax(-1).tolist()  # all the round's target choices in one read
    else:
        p = torch.softmax(logits.double() / temperature, -1)
        rows = torch.arange(k, device=p.device)
        ratio = p[rows, drafts] / q[rows, drafts]  # accept draft i with probability min(1, ratio)
    emitted = []
    for i, d in enumerate(drafts.tolist()):
        stats.reached[i] += 1
        if temperature <= 0:
            ok = d == best[i]
        else:
            ok = bool(torch.rand(1, generator=gen, dtype=torch.double, device=p.device) < ratio[i])
        if not ok:
            emitted.append(best[i] if temperature <= 0 else _correction(p[i], q[i], gen))
            break
        stats.accepted += 1
        stats.accepted_at[i] += 1
        emitted.append(d)
        if d == eos_id:
            break
    else:  # all k accepted: a bonus token
        emitted.append(best[k] if temperature <= 0
                       else int(torch.multinomial(p[k], 1, generator=gen)))
    stats.emitted += len(emitted)
    return emitted


def _correction(p, q, gen) -> int:
    """A draw from norm(max(0, p - q)): what a rejected draft is replaced with."""
    residual = (p - q).clamp_min(0)
    if residual.sum() <= 0:  # p == q exactly: any draw from p is right
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=gen))


def measure(model, proposer, prompts_ids, *, k, aux_layers, max_new_tokens, eos_id, temperature,
            seed: int, desc: str) -> tuple[dict, list[list[int]]]:
    """The drafter behind `proposer` with `model` on each prompt (token ids): the rounds'
    summed SpecStats summary with the acceptance length's standard error over prompts, and
    each prompt's output. Prompt i samples from its own seed."""
    total = SpecStats(accepted_at=[0] * k, reached=[0] * k)
    outputs, per_prompt = [], []
    for i, ids in enumerate(tqdm(prompts_ids, desc=desc, unit="prompt")):
        gen = torch.Generator(model.device).manual_seed(seed * 1_000_003 + i)
        out, stats = generate(model, proposer, ids, k=k, aux_layers=aux_layers,
                              max_new_tokens=max_new_tokens, eos_id=eos_id,
                              temperature=temperature, gen=gen)
        total.add(stats)
        outputs.append(out)
        per_prompt.append((stats.emitted, stats.rounds))
    se = ratio_standard_error(per_prompt)
    summary = {**total.summary(), "acceptance_length_se": se if se is None else round(se, 4)}
    return summary, outputs


def ratio_standard_error(units: list[tuple[float, float]]) -> float | None:
    """The standard error of sum(e) / sum(r) over independent units (e, r), by the delta
    method; None below 2 units. For acceptance length the units are prompts, each (tokens
    emitted, rounds): a prompt's rounds share one text and context, so they are not independent
    of each other, and an error over rounds would come out several times too small. It is how
    far the figure moves with other prompts from the same source, or at T > 0 another seed."""
    n, rounds = len(units), sum(r for _, r in units)
    if n < 2 or rounds == 0:
        return None
    ratio = sum(e for e, _ in units) / rounds
    return math.sqrt(n / (n - 1) * sum((e - ratio * r) ** 2 for e, r in units)) / rounds
