"""Training data: hidden-state samples read lazily, packed into fixed-length rows.

A row holds several samples end to end, up to `seq_len` tokens; `doc` gives each token's
sample index in the row (-1 on the padding at the end) and `pos` its position in its sample,
so attention stays within a sample (a document mask) and rotary positions restart per sample.
Every row has the same length, so every step has the same shapes (one compile, no padding
compute beyond the row's tail).

Samples are read as safetensors slices of the hidden shards (at H=7168 a shard is tens of GB:
only the rows a step needs are read), in DataLoader workers, into pinned memory on CUDA.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.artifacts import read_hidden_manifest
from draftsmith.errors import DraftsmithError


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


@dataclass(frozen=True)
class Sample:
    id: str
    shard: int
    start: int  # token offset in the shard
    length: int


class HiddenStore:
    """The hidden artifact's samples, indexed from the manifest; read by slices."""

    def __init__(self, hidden_dir: Path):
        self.dir = Path(hidden_dir)
        m = read_hidden_manifest(hidden_dir)
        self.aux_layers = m["aux_layers"]
        self.files = [s["file"] for s in m["shards"]]
        self.samples: list[Sample] = []
        for s, shard in enumerate(m["shards"]):
            lengths = shard.get("lengths") or self._lengths(shard["file"])
            start = 0
            for sid, n in zip(shard["ids"], lengths):
                self.samples.append(Sample(sid, s, start, n))
                start += n
        self._open: dict[int, object] = {}  # per process: DataLoader workers open their own

    def _lengths(self, file: str) -> list[int]:
        with safe_open(self.dir / file, "pt") as f:
            return f.get_tensor("cu_seqlens").diff().tolist()

    def read(self, i: int):
        """-> aux, final, input_ids, loss_mask of sample i (only its rows are read)."""
        s = self.samples[i]
        f = self._open.get(s.shard)
        if f is None:
            f = self._open[s.shard] = safe_open(self.dir / self.files[s.shard], "pt")
        a, b = s.start, s.start + s.length
        return (f.get_slice("aux")[a:b], f.get_slice("final")[a:b],
                f.get_slice("input_ids")[a:b].long(), f.get_slice("loss_mask")[a:b].bool())

    def __getstate__(self):  # file handles do not cross into worker processes
        return {**self.__dict__, "_open": {}}

    def split(self, eval_samples: int) -> tuple[list[int], list[int]]:
        """(train, held-out) sample indices; held-out = the lowest sample ids."""
        ids = sorted(s.id for s in self.samples)
        held = set(ids[:eval_samples]) if eval_samples < len(ids) else set()
        train = [i for i, s in enumerate(self.samples) if s.id not in held]
        return train, [i for i, s in enumerate(self.samples) if s.id in held]

    def check_fits(self, seq_len: int) -> None:
        """Before any work: every sample must fit in a row."""
        longest = max(s.length for s in self.samples)
        if longest > seq_len:
            raise DraftsmithError(
                f"the longest sample has {longest} tokens, more than train.seq_len={seq_len}",
                f"set train.seq_len >= {longest} (tokens per packed row), or drop long samples "
                "with tokenize.max_length")


def pack(lengths: dict[int, int], seq_len: int, rng: random.Random | None) -> list[list[int]]:
    """Pack samples (index -> length) into rows of at most seq_len tokens: first fit over the
    open rows, in random order (rng) or in index order (None, for evaluation)."""
    order = sorted(lengths)
    if rng is not None:
        rng.shuffle(order)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        r = next((r for r in range(max(0, len(rows) - 64), len(rows)) if room[r] >= n), None)
        if r is None:  # only the last 64 rows are searched: packing stays O(samples)
            rows.append([])
            room.append(seq_len)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= n
    return rows


def schedule(store: HiddenStore, members: list[int], seq_len: int, batch_size: int,
             seed: int, epoch: int) -> list[list[list[int]]]:
    """One epoch's steps, each `batch_size` packed rows. A function of (seed, epoch) only, so
    a resumed run replays the same steps."""
    rng = random.Random(seed * 100_003 + epoch)
    rows = pack({i: store.samples[i].length for i in members}, seq_len, rng)
    rng.shuffle(rows)
    return [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]


def eval_steps(store: HiddenStore, members: list[int], seq_len: int, batch_size: int):
    rows = pack({i: store.samples[i].length for i in members}, seq_len, None)
    return [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]


def make_batch(store: HiddenStore, rows: list[list[int]], seq_len: int) -> Batch:
    """Rows of sample indices -> one Batch of (len(rows), seq_len) tokens."""
    first = store.read(rows[0][0])
    B = len(rows)
    aux = torch.zeros(B, seq_len, first[0].shape[-1], dtype=first[0].dtype)
    final = torch.zeros(B, seq_len, first[1].shape[-1], dtype=first[1].dtype)
    ids = torch.zeros(B, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(B, seq_len, dtype=torch.bool)
    doc = torch.full((B, seq_len), -1, dtype=torch.long)
    pos = torch.zeros(B, seq_len, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for d, i in enumerate(row):
            a, f, x, m = store.read(i)
            n = len(x)
            sl = slice(at, at + n)
            aux[r, sl], final[r, sl], ids[r, sl], loss_mask[r, sl] = a, f, x, m
            doc[r, sl] = d
            pos[r, sl] = torch.arange(n)
            at += n
    return Batch(aux, final, ids, loss_mask, doc, pos)


class Steps(torch.utils.data.Dataset):
    """Step i's batch, built in a DataLoader worker."""

    def __init__(self, store: HiddenStore, steps: list[list[list[int]]], seq_len: int):
        self.store, self.steps, self.seq_len = store, steps, seq_len

    def __len__(self):
        return len(self.steps)

    def __getitem__(self, i) -> Batch:
        return make_batch(self.store, self.steps[i], self.seq_len)


def loader(store: HiddenStore, steps, seq_len: int, *, device: torch.device, workers: int):
    """Batches in order, prefetched by `workers` processes into pinned memory on CUDA."""
    return torch.utils.data.DataLoader(
        Steps(store, steps, seq_len), batch_size=None, shuffle=False, num_workers=workers,
        pin_memory=device.type == "cuda", prefetch_factor=4 if workers else None,
        persistent_workers=False)
