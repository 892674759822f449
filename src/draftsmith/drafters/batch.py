"""A training batch: what every method's objective reads (train/data.py makes them)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class Batch:
    aux: torch.Tensor  # (B, T, 3Ht) target aux states, stored dtype
    final: torch.Tensor  # (B, T, Ht) target's last hidden state, after its final norm
    ids: torch.Tensor  # (B, T) int64
    loss_mask: torch.Tensor  # (B, T) bool: response tokens
    doc: torch.Tensor  # (B, T) int64: sample index within the row, -1 on padding
    pos: torch.Tensor  # (B, T) int64: position within the sample

    def to(self, device, non_blocking: bool = False) -> Batch:
        return Batch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                        for f in fields(self)})

    def pin_memory(self) -> Batch:  # called by DataLoader(pin_memory=True)
        return Batch(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})

    @property
    def tokens(self) -> torch.Tensor:
        return (self.doc >= 0).sum()
