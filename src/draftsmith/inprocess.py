"""Batched, KV-cached sampling from an in-process transformers model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


@dataclass
class Completion:
    text: str  # decoded with special tokens kept: exactly what the model emitted
    num_tokens: int
    finish_reason: str  # "stop" (end-of-turn emitted) or "length" (hit max_new_tokens)


def complete(model, tokenizer, prompts: list[str], **kw) -> list[Completion]:
    """Complete each prompt text; results in input order (see `complete_iter`)."""
    results: list[Completion | None] = [None] * len(prompts)
    for i, c in complete_iter(model, tokenizer, prompts, **kw):
        results[i] = c
    return results  # type: ignore[return-value]


@torch.no_grad()
def complete_iter(model, tokenizer, prompts: list[str], *, eos_token_id: int,
                  max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                  seed: int = 0, batch_size: int = 64, progress: str | None = None
                  ) -> Iterator[tuple[int, Completion]]:
    """Yield (prompt index, completion) batch by batch. Prompts are batched by length (less
    padding). Sampling is seeded per batch, so a run is repeatable."""
    model.eval()
    tokenizer.padding_side = "left"
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (len(encoded[i]), i))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for b, idx in enumerate(tqdm(batches, desc=progress, disable=progress is None, unit="batch")):
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in idx]}, return_tensors="pt")
        torch.manual_seed(seed * 1_000_003 + b)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 \
            else dict(do_sample=False)
        out = model.generate(
            input_ids=batch["input_ids"].to(model.device),
            attention_mask=batch["attention_mask"].to(model.device),
            max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
            pad_token_id=tokenizer.pad_token_id, top_k=None, **sampling,
        )
        new = out[:, batch["input_ids"].shape[1]:].tolist()
        for i, ids in zip(idx, new):
            if eos_token_id in ids:
                ids, reason = ids[: ids.index(eos_token_id) + 1], "stop"
            else:
                reason = "length"
            yield i, Completion(tokenizer.decode(ids, skip_special_tokens=False), len(ids), reason)
