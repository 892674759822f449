"""A reference speculative-decoding engine: chain drafts of k tokens, verified by the target.

Each round: the drafter proposes k tokens from the target's aux hidden states (exactly as an
engine feeds an EAGLE-3 drafter: prefill over the verified prefix, then k chained steps); one
target forward over prefix + drafts verifies them. Greedy: a draft is accepted while it equals
the target's argmax. Sampling: draft x ~ q is accepted with probability min(1, p(x)/q(x)); on
rejection the replacement is drawn from norm(max(0, p - q)); after k acceptances a bonus token
is drawn from p. The output is then distributed exactly as the target's own sampling (Leviathan
et al. 2023), which tests/test_speculative.py checks statistically.

Clarity over speed: the target re-reads the whole sequence each round (no KV cache), which is
fine for the small models this verifies on; acceptance, not wall time, is what it measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.hidden import capture


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


class Eagle3Proposer:
    """Drafts with a trained EAGLE-3 drafter fed the target's aux hidden states."""

    def __init__(self, drafter):
        self.drafter = drafter.eval()
        self.draft_ids = drafter.d2t + torch.arange(len(drafter.d2t))

    @torch.no_grad()
    def propose(self, aux, ids, k: int, temperature: float, gen: torch.Generator):
        """aux: (n-1, 3H) for positions 0..n-2 of ids (n tokens). Returns k target-vocab token
        ids and, when sampling, their q rows (k, V) over the target vocab."""
        d = self.drafter
        drafts, qs = [], []

        def pick(_j, logits):
            tok, q = _pick(logits, temperature, gen)
            drafts.append(int(self.draft_ids[tok]))
            if q is not None:
                full = torch.zeros(d.config.vocab_size, dtype=q.dtype)
                full[self.draft_ids] = q
                qs.append(full)
            return drafts[-1]

        logits = d.chain(aux[None].to(d.fc.weight.dtype), ids[None, 1:], k, pick)
        pick(k - 1, logits[-1])  # the last step's draft (the chain only asks for k - 1)
        return drafts, (torch.stack(qs) if qs else None)


class TargetProposer:
    """The target drafting for itself (a perfect drafter at greedy: acceptance k + 1)."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def propose(self, aux, ids, k: int, temperature: float, gen: torch.Generator):
        seq = ids.tolist()
        drafts, qs = [], []
        for _ in range(k):
            logits = self.model(input_ids=torch.tensor([seq])).logits[0, -1]
            tok, q = _pick(logits, temperature, gen)
            drafts.append(tok)
            seq.append(tok)
            if q is not None:
                qs.append(q)
        return drafts, (torch.stack(qs) if qs else None)


def _pick(logits, temperature: float, gen):
    if temperature <= 0:
        return int(logits.argmax()), None
    q = torch.softmax(logits.double() / temperature, -1)
    return int(torch.multinomial(q, 1, generator=gen)), q


@torch.no_grad()
def target_forward(model, ids, aux_layers):
    aux, final = capture(model, ids[None], torch.ones(1, len(ids), dtype=torch.long), aux_layers)
    logits = final @ model.get_output_embeddings().weight.T
    return aux[0], logits[0]


@torch.no_grad()
def generate(model, proposer, prompt_ids: list[int], *, k: int, aux_layers: list[int],
             max_new_tokens: int, eos_id: int, temperature: float = 0.0,
             gen: torch.Generator | None = None) -> tuple[list[int], SpecStats]:
    """Speculative generation from one prompt. Returns (new tokens, stats)."""
    gen = gen or torch.Generator().manual_seed(0)
    stats = SpecStats(accepted_at=[0] * k, reached=[0] * k)
    ids = torch.tensor(prompt_ids)
    aux, logits = target_forward(model, ids, aux_layers)  # prefill: first token from the target
    first, _ = _pick(logits[-1], temperature, gen)
    out = [first]
    while out[-1] != eos_id and len(out) < max_new_tokens:
        seq = torch.cat([ids, torch.tensor(out)])
        n = len(seq)
        drafts, q = proposer.propose(aux[: n - 1], seq, k, temperature, gen)
        aux, logits = target_forward(model, torch.cat([seq, torch.tensor(drafts)]), aux_layers)
        p_rows = logits[n - 1: n + k]  # row i: target's distribution for the token after i
        emitted = []
        stats.rounds += 1
        stats.drafted += k
        for i, d in enumerate(drafts):
            stats.reached[i] += 1
            if temperature <= 0:
                ok = d == int(p_rows[i].argmax())
            else:
                p = torch.softmax(p_rows[i].double() / temperature, -1)
                ok = bool(torch.rand(1, generator=gen, dtype=torch.double) < p[d] / q[i][d])
            if not ok:
                emitted.append(_correction(p_rows[i], None if q is None else q[i], temperature, gen))
                break
            stats.accepted += 1
            stats.accepted_at[i] += 1
            emitted.append(d)
            if d == eos_id:
                break
        else:
            emitted.append(_pick(p_rows[k], temperature, gen)[0])  # bonus token
        stats.emitted += len(emitted)
        out += emitted
    if eos_id in out:
        out = out[: out.index(eos_id) + 1]
    return out[:max_new_tokens], stats


def _correction(logits, q, temperature: float, gen) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    p = torch.softmax(logits.double() / temperature, -1)
    residual = (p - q).clamp_min(0)
    if residual.sum() <= 0:  # p == q exactly: any draw from p is right
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
