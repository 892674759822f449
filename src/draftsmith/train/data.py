"""Training data: hidden-state samples read lazily, packed into fixed-length rows.

A row holds several samples end to end, up to `seq_len` tokens; `doc` gives each token's
sample index in the row (-1 on the padding at the end) and `pos` its position in its sample,
so attention stays within a sample (a document mask) and rotary positions restart per sample.
Every row has the same length, so every step has the same shapes (one compile, no padding
compute beyond the row's tail).

Samples are read as safetensors slices of the hidden shards (at H=7168 a shard is tens of GB:
only the rows a step needs are read; fp8 ones dequantized), in DataLoader workers, into pinned
memory on CUDA. In online mode (`TokenStore`) only ids and masks are read, and the trainer runs
the target on each batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.artifacts import TOKENIZED_MANIFEST, read_manifest
from draftsmith.drafters.batch import Batch
from draftsmith.errors import DraftsmithError
from draftsmith.hidden_format import STATE_KEYS, hidden_states, read_hidden_manifest
from draftsmith.packing import first_fit


@dataclass(frozen=True)
class Sample:
    id: str
    shard: int
    start: int  # token offset in the shard
    length: int


class HiddenStore:
    """The hidden artifact's samples, indexed from the manifest; read by slices."""

    def __init__(self, hidden_dir: Path, verify: bool = True):
        m = read_hidden_manifest(hidden_dir)
        self._index(Path(hidden_dir), m["shards"])
        self.aux_layers = m["aux_layers"]
        if verify:
            self.verify(m["shards"])

    def _index(self, folder: Path, shards: list[dict]) -> None:
        self.dir = folder
        self.files = [s["file"] for s in shards]
        self.samples: list[Sample] = []
        for s, shard in enumerate(shards):
            lengths = shard.get("lengths") or self._lengths(shard["file"])
            start = 0
            for sid, n in zip(shard["ids"], lengths):
                self.samples.append(Sample(sid, s, start, n))
                start += n
        self._open: dict[int, object] = {}  # per process: DataLoader workers open their own

    def verify(self, shards: list[dict]) -> None:
        """Before training reads anything: every shard has the size and sha256 its manifest
        recorded (manifests written before checksums are trusted as they are)."""
        from concurrent.futures import ThreadPoolExecutor

        from draftsmith.atomic import check_digest

        fix = "rerun the hidden stage (`dvc repro hidden`, or `dvc pull` the artifact again)"
        todo = [s for s in shards if "sha256" in s]
        with ThreadPoolExecutor(max_workers=4) as pool:  # hashing runs without the GIL
            for f in [pool.submit(check_digest, self.dir / s["file"], s, fix) for s in todo]:
                f.result()

    def _lengths(self, file: str) -> list[int]:
        with safe_open(self.dir / file, "pt") as f:
            return f.get_tensor("cu_seqlens").diff().tolist()

    def _slices(self, i: int, keys) -> dict:
        s = self.samples[i]
        f = self._open.get(s.shard)
        if f is None:
            f = self._open[s.shard] = safe_open(self.dir / self.files[s.shard], "pt")
        a, b = s.start, s.start + s.length
        return {k: f.get_slice(k)[a:b] for k in keys if k in f.keys()}

    def read(self, i: int):
        """-> aux, final, input_ids, loss_mask of sample i (only its rows are read); fp8
        states dequantized to bf16."""
        t = self._slices(i, ("input_ids", "loss_mask", *STATE_KEYS))
        aux, final = hidden_states(t)
        return aux, final, t["input_ids"].long(), t["loss_mask"].bool()

    def tokens(self, i: int):
        """-> input_ids, loss_mask of sample i, no states read."""
        t = self._slices(i, ("input_ids", "loss_mask"))
        return t["input_ids"].long(), t["loss_mask"].bool()

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


class TokenStore(HiddenStore):
    """Online mode (hidden.mode: online): the tokenized samples and no states; the trainer runs
    the target on each batch instead (Trainer.with_target_states)."""

    def __init__(self, tokenized_dir: Path, hidden_dir: Path):
        manifest = read_manifest(Path(tokenized_dir) / TOKENIZED_MANIFEST, "tokenize")
        self._index(Path(tokenized_dir), manifest["shards"])
        self.aux_layers = read_hidden_manifest(hidden_dir)["aux_layers"]

    def read(self, i: int):
        return None, None, *self.tokens(i)


def pack(lengths: dict[int, int], seq_len: int, rng: random.Random | None) -> list[list[int]]:
    """Pack samples (index -> length) into rows of at most seq_len tokens: first fit, in random
    order (rng) or in the dict's order (None, for evaluation)."""
    order = list(lengths)
    if rng is not None:
        rng.shuffle(order)
    return first_fit(order, lengths, seq_len)


def _by_id(store: HiddenStore, members: list[int]) -> dict[int, int]:
    """index -> length of the members, in sample-id order: so the batches depend on which
    samples there are, not on where the hidden stage put them (offline shards of any size or
    dtype, or online mode's tokenized order)."""
    return {i: store.samples[i].length
            for i in sorted(members, key=lambda i: store.samples[i].id)}


def schedule(store: HiddenStore, members: list[int], seq_len: int, batch_size: int,
             seed: int, epoch: int) -> list[list[list[int]]]:
    """One epoch's steps, each `batch_size` packed rows. A function of (seed, epoch, the
    samples) only, so a resumed run replays the same steps."""
    rng = random.Random(seed * 100_003 + epoch)
    rows = pack(_by_id(store, members), seq_len, rng)
    rng.shuffle(rows)
    return [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]


def eval_steps(store: HiddenStore, members: list[int], seq_len: int, batch_size: int):
    rows = pack(_by_id(store, members), seq_len, None)
    return [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]


def make_batch(store: HiddenStore, rows: list[list[int]], seq_len: int) -> Batch:
    """Rows of sample indices -> one Batch of (len(rows), seq_len) tokens."""
    # A process of a data-parallel step may get only an empty row (dist.split): it still
    # needs the states' width.
    first = store.read(next((i for row in rows for i in row), 0))
    B = len(rows)
    online = first[0] is None  # no stored states: (B, T, 0) placeholders
    aux = torch.zeros(B, seq_len, 0 if online else first[0].shape[-1],
                      dtype=torch.bfloat16 if online else first[0].dtype)
    final = torch.zeros(B, seq_len, 0 if online else first[1].shape[-1], dtype=aux.dtype)
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
            ids[r, sl], loss_mask[r, sl] = x, m
            if not online:
                aux[r, sl], final[r, sl] = a, f
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
