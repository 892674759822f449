"""Acceptance of a drafter measured inside a serving engine, from the engine's own counts.

Engines count, per speculative step ("draft"), the tokens proposed and accepted, and how many
were accepted at each draft position. Where they report it (engines.py): vLLM on `/metrics`
(`vllm:spec_decode_*`, summed over the server's life: the difference of two scrapes around a
batch of requests gives that batch's figures); SGLang in each response, for its own request
(summed over the batch). Either way the figures come out in the same schema as the reference
engine's `SpecStats.summary`, so they can sit in one table.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.serving import prometheus
from draftsmith.serving.engines import DEFAULT, ENGINES


@dataclass
class Counters:
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_at: list[float]

    @classmethod
    def scrape(cls, url: str, k: int, engine: str = DEFAULT) -> Counters:
        m = ENGINES[engine].spec_metrics
        s = prometheus.scrape(url)
        return cls(prometheus.total(s, m.drafts), prometheus.total(s, m.draft_tokens),
                   prometheus.total(s, m.accepted),
                   [prometheus.total(s, m.accepted_per_position, position=str(i))
                    for i in range(k)])

    @classmethod
    def from_responses(cls, choices, k: int, engine: str) -> Counters:
        """The sum of the counts each response carries (engines with `spec_response`)."""
        total = cls(0.0, 0.0, 0.0, [0.0] * k)
        for choice in choices:
            got = ENGINES[engine].spec_response.read(choice, k)
            if got is not None:
                total = total + cls(*got)
        return total

    def __add__(self, other: Counters) -> Counters:
        return Counters(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                        self.accepted + other.accepted,
                        [a + b for a, b in zip(self.accepted_at, other.accepted_at)])

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                        self.accepted - other.accepted,
                        [a - b for a, b in zip(self.accepted_at, other.accepted_at)])

    def summary(self) -> dict:
        """Same keys as the reference engine's summary. A draft is one verification step; it
        emits its accepted tokens plus one from the target (vLLM's mean acceptance length)."""
        rounds = max(1.0, self.drafts)
        emitted = self.drafts + self.accepted
        # Position i is judged only when every earlier draft was accepted.
        reached = [self.drafts, *self.accepted_at[:-1]]
        return {
            "acceptance_length": round(emitted / rounds, 4),
            "acceptance_rate_per_position": [round(a / rounds, 4) for a in self.accepted_at],
            "conditional_acceptance_per_position": [round(a / max(1.0, r), 4)
                                                    for a, r in zip(self.accepted_at, reached)],
            "draft_acceptance_rate": round(self.accepted / max(1.0, self.draft_tokens), 4),
            "target_forwards_saved": round(1 - self.drafts / max(1.0, emitted), 4),
            "rounds": int(self.drafts), "k": len(self.accepted_at),
        }
