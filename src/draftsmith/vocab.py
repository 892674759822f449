"""Vocab stage: the draft vocabulary and its maps to and from the target's.

The draft vocab is the `draft_vocab_size` most frequent target tokens among loss-masked
(response) tokens, ties broken by the lower token id, kept in ascending target-id order. The
engines' convention (vLLM llama_eagle3.py, SGLang): `d2t[i]` is an OFFSET, target_id =
draft_id + d2t[draft_id]; `t2d` is a bool mask over the target vocab. When fewer distinct
tokens were seen than asked for, the rest is padded with the lowest unseen target ids
(documented, counted in the metrics) so the drafter keeps the configured shape.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.atomic import atomic_path
from draftsmith.config import VocabConfig
from draftsmith.artifacts import iter_samples

VOCAB_FILE = "vocab.safetensors"


def token_counts(tokenized_dir: Path, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for _, ids, mask in iter_samples(tokenized_dir):
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def select(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Target ids of the draft vocab, ascending. Frequency first, then lower id."""
    ids = torch.arange(len(counts))
    # Stable sort by descending count keeps ascending id order among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(ids[order[:draft_vocab_size]]).values


def maps(draft_to_target: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = draft_to_target - torch.arange(len(draft_to_target))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_to_target] = True
    return d2t, t2d


def draft_ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(len(d2t), device=d2t.device) + d2t


def run(cfg: VocabConfig, tokenized_dir: Path, vocab_size: int, out_dir: Path) -> dict:
    counts = token_counts(tokenized_dir, vocab_size)
    seen = int((counts > 0).sum())
    chosen = select(counts, cfg.draft_vocab_size)
    d2t, t2d = maps(chosen, vocab_size)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, tmp / VOCAB_FILE)
    total = int(counts.sum())
    return {
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_vocab_size": vocab_size,
        "distinct_loss_tokens": seen,
        "padded_tokens": max(0, cfg.draft_vocab_size - seen),
        "coverage": round(int(counts[chosen].sum()) / total, 6) if total else 0.0,
        "loss_tokens": total,
    }


def load(vocab_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    t = load_file(Path(vocab_dir) / VOCAB_FILE)
    return t["d2t"], t["t2d"]
