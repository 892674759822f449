"""Online training from the serving engine (`hidden.mode: online`, `hidden.engine: vllm`): the
target runs in vLLM, which captures each sample's states as training needs them; nothing is
stored but what is in flight.

Between engine and trainer the only disk is the engine's own: vLLM's capture connector writes a
finished request's states to a file (serving/hidden_states.py), which is read and deleted as
soon as the request returns. At most `server.concurrency` requests are in flight, so the disk
holds at most that many samples' states (`disk_bound`; `DiskPeak` measures it). The states go
to memory instead: a thread fetches the samples of the next `hidden.online_ahead` steps while the
trainer runs the current one, and each step's batch is built as the offline store's would be
(the same storage dtype, so a drafter trained online equals one trained offline on the same
captured states in the same order; fp8, which exists to halve the disk, is held as bf16).

A resumed run replays the same steps from its checkpoint (the plan is a function of the seed and
the samples): the states of the steps after it are fetched again, so nothing is lost and no step
trained twice beyond those the checkpoint did not hold (metrics: resumed_from_step).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.hidden_format import (FP8, HIDDEN_MANIFEST, encode, hidden_states,
                                      offline_manifest, read_hidden_manifest, sample_tensors,
                                      shard_entry, shard_file)
from draftsmith.train.data import TokenStore, make_batch


class EngineStore(TokenStore):
    """The tokenized samples; their states fetched from the engine (a HiddenStatesClient) and
    held only while a step or evaluation that needs them is ahead."""

    def __init__(self, tokenized_dir: Path, hidden_dir: Path):
        super().__init__(tokenized_dir, hidden_dir)
        self.dtype = read_hidden_manifest(hidden_dir).get("dtype", "bfloat16")
        self.client = None  # set by the caller, which owns the server
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.fetched = 0  # tokens the engine computed
        self.keep_dir: Path | None = None  # hybrid: where fetched states are also written
        self.kept: dict[int, tuple[str, int]] = {}  # sample -> (its kept shard, first token)
        self._kept_open: dict[str, object] = {}

    def keep_in(self, folder: Path, key: str) -> None:
        """Hybrid: also write the fetched states to `folder` as hidden shards with a manifest,
        so the folder is an offline hidden artifact of the samples fetched so far (every
        sample once the first epoch and the evaluation are done); samples already there are
        read back instead of fetched again. `key` names the inputs (target, data, layers,
        dtype): a folder kept for other inputs is emptied."""
        folder.mkdir(parents=True, exist_ok=True)
        index = folder / HIDDEN_MANIFEST
        manifest = json.loads(index.read_text()) if index.exists() else {}
        if manifest.get("key") != key:
            for f in list(folder.iterdir()):
                f.unlink()
            manifest = {}
        for f in folder.glob(".*.tmp"):
            f.unlink()  # a shard half-written when the run was killed
        self.keep_dir, self._shards = folder, manifest.get("shards", [])
        self._key = key
        by_id = {s.id: i for i, s in enumerate(self.samples)}
        for shard in self._shards:
            at = 0
            for sid, n in zip(shard["ids"], shard["lengths"]):
                self.kept[by_id[sid]] = (shard["file"], at)
                at += n

    def read(self, i: int):
        _, _, ids, mask = TokenStore.read(self, i)
        with self._lock:
            aux, final = self.states[i]
        return aux, final, ids, mask

    def fetch(self, indices: list[int]) -> int:
        """The engine's states of these samples (or, kept, read back), stored as the hidden
        stage stores them; -> tokens the engine computed."""
        need = [i for i in indices if i not in self.states]
        for i in [i for i in need if i in self.kept]:
            self._hold(i, self._read_kept(i))
        need = [i for i in need if i not in self.kept]
        if not need:
            return 0
        by_id = {self.samples[i].id: i for i in need}
        got = self.client.states_of([(sid, self._ids(i)) for sid, i in by_id.items()])
        for sid, (aux, final) in got.items():
            self._hold(by_id[sid], hidden_states(encode(aux, final, self.held_dtype,
                                                        aux.shape[-1] // final.shape[-1])))
        if self.keep_dir is not None:
            self._write_kept(need)
        tokens = sum(self.samples[i].length for i in need)
        self.fetched += tokens
        return tokens

    @property
    def held_dtype(self) -> str:
        """fp8 storage halves the disk, and online nothing is stored: bf16 in memory then."""
        return "bfloat16" if self.dtype == FP8 else self.dtype

    def _ids(self, i: int) -> torch.Tensor:
        return TokenStore.read(self, i)[2]

    def _hold(self, i: int, states: tuple) -> None:
        with self._lock:
            self.states[i] = states

    def _write_kept(self, members: list[int]) -> None:
        """These samples' states as one more shard of the kept artifact (write, then rename;
        the manifest last, so a killed run keeps only whole shards)."""
        from safetensors.torch import save_file

        from draftsmith.atomic import file_sha256, write_json

        with self._lock:
            states = [self.states[i] for i in members]
        tensors = {"aux": torch.cat([a for a, _ in states]),
                   "final": torch.cat([f for _, f in states]),
                   **sample_tensors([TokenStore.read(self, i)[1:] for i in members])}
        path = self.keep_dir / shard_file(len(self._shards))
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, tmp)
        tmp.rename(path)
        entry = shard_entry(len(self._shards), [self.samples[i].id for i in members],
                            [self.samples[i].length for i in members],
                            {"bytes": path.stat().st_size, "sha256": file_sha256(path)})
        self._shards.append(entry)
        at = 0
        for i in members:
            self.kept[i] = (entry["file"], at)
            at += self.samples[i].length
        hidden_size = tensors["final"].shape[-1]
        write_json(self.keep_dir / HIDDEN_MANIFEST, {
            **offline_manifest(self.aux_layers, hidden_size, self.held_dtype, self._shards),
            "key": self._key})

    def _read_kept(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors import safe_open

        file, at = self.kept[i]
        n = self.samples[i].length
        f = self._kept_open.get(file)  # later epochs read every sample: open each shard once
        if f is None:
            f = self._kept_open[file] = safe_open(self.keep_dir / file, "pt")
        return hidden_states({k: f.get_slice(k)[at:at + n] for k in ("aux", "final")})

    def drop(self, indices: list[int]) -> None:
        with self._lock:
            for i in indices:
                self.states.pop(i, None)


class EngineFeed:
    """The steps' batches in order; a thread fetches each step's states `ahead` steps before
    the trainer takes it. Rates: `engine_tokens_per_s` (fetching alone) and `idle_s` (the
    trainer waiting for a batch).

    It also says, once each, what a user would otherwise only see as a stalled progress bar:
    no states for much longer than the steps so far took (`stall_floor_s`, or `stall_factor`
    times their median step, whichever is longer; it goes on waiting, the client's own
    timeouts still apply), and the machine's available memory falling below `low_memory`
    (a share of it) while training: the engine and the trainer share it, and past it the
    machine swaps or kills one of them. server_log: the launched server's log, named there."""

    def __init__(self, store: EngineStore, steps: list, seq_len: int, ahead: int,
                 server_log: Path | None = None, stall_floor_s: float = 60.0,
                 stall_factor: float = 20.0, low_memory: float = 0.05, meminfo=None):
        from draftsmith.serving.memory import meminfo as read_meminfo

        self.store, self.steps, self.seq_len = store, steps, seq_len
        self.ready: queue.Queue = queue.Queue(maxsize=ahead)
        self.fetched_tokens, self.fetch_s, self.idle_s = 0, 0.0, 0.0
        self.ahead, self.server_log = ahead, server_log
        self.stall_floor_s, self.stall_factor = stall_floor_s, stall_factor
        self.low_memory, self.meminfo = low_memory, meminfo or read_meminfo
        self.step_s: list[float] = []  # each step's time, from one batch taken to the next
        self.reported: set[str] = set()  # "stall", "memory": each said once
        self._memory_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="engine-feed", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():  # a full queue: the engine is ahead of the trainer
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for rows in self.steps:
                members = [i for row in rows for i in row]
                t0 = time.perf_counter()
                self.fetched_tokens += self.store.fetch(members)
                self.fetch_s += time.perf_counter() - t0
                batch = make_batch(self.store, rows, self.seq_len)
                self.store.drop(members)
                if not self._put(batch):
                    return
        except BaseException as exc:  # the trainer raises it at the step that needed it
            self._put(exc)
            return
        self._put(None)

    def __iter__(self):
        last = None  # when the trainer took the last batch
        while True:
            t0 = time.perf_counter()
            if last is not None:
                self.step_s.append(t0 - last)
            self._check_memory()
            item = self._wait(t0)
            last = time.perf_counter()
            self.idle_s += last - t0
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    @property
    def stall_after_s(self) -> float:
        """Seconds without states after which the feed counts as stalled."""
        steps = sorted(self.step_s)
        median = steps[len(steps) // 2] if steps else 0.0
        return max(self.stall_floor_s, self.stall_factor * median)

    def _wait(self, t0: float):
        """The next item; says once when it is much later than the steps so far."""
        while True:
            waited = time.perf_counter() - t0
            limit = self.stall_after_s
            try:
                return self.ready.get(timeout=max(limit - waited, 0.05)
                                      if "stall" not in self.reported else None)
            except queue.Empty:
                if time.perf_counter() - t0 >= limit:
                    self._report("stall", self._stall_message(time.perf_counter() - t0))

    def _stall_message(self, waited: float) -> str:
        steps = sorted(self.step_s)
        took = (f"the {len(steps)} steps so far took {steps[len(steps) // 2]:.2f} s each "
                "(median)") if steps else "no step has been trained yet"
        return (f"train: WARNING no states from the engine for {waited:.0f} s, where {took}; "
                f"still waiting (server.request_timeout_s and server.max_retries apply). "
                f"Check: the server's log ({self.server_log or 'of the server in server.urls'}); "
                f"the machine's memory ({self._memory_line()}): swapping or an engine killed for "
                "memory (dmesg) stalls it, and the engine's KV cache and the trainer share it "
                "(docs/performance.md#online-from-the-serving-engine); server.concurrency "
                f"(requests in flight) and hidden.online_ahead={self.ahead} (steps fetched "
                "ahead): lower them to hold fewer states at once")

    def _memory_line(self) -> str:
        from draftsmith.serving.memory import gib

        m = self.meminfo()
        if "MemAvailable" not in m:
            return "not readable here"
        swap = m.get("SwapTotal", 0) - m.get("SwapFree", 0)
        return (f"{gib(m['MemAvailable'])} of {gib(m['MemTotal'])} available, "
                f"{gib(swap)} swap used")

    def _check_memory(self) -> None:
        """At most once a second: the machine's available memory, reported once when low."""
        now = time.perf_counter()
        if "memory" in self.reported or now - self._memory_at < 1.0:
            return
        self._memory_at = now
        m = self.meminfo()
        if "MemAvailable" in m and m["MemAvailable"] < self.low_memory * m["MemTotal"]:
            self._report("memory", (
                f"train: WARNING the machine is low on memory while training online "
                f"({self._memory_line()}): the engine's KV cache and the trainer share it, and "
                "past it the machine swaps or kills one of them. Check the engine's memory "
                "flags in server.extra_args (docs/serving.md#the-engines-memory), "
                f"server.concurrency and hidden.online_ahead={self.ahead}"))

    def _report(self, what: str, message: str) -> None:
        if what not in self.reported:
            self.reported.add(what)
            tqdm.write(message, file=sys.stderr)

    @property
    def engine_tokens_per_s(self) -> float | None:
        return round(self.fetched_tokens / self.fetch_s, 1) if self.fetch_s else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


class DiskPeak:
    """The most bytes a folder held, sampled every `every` seconds while in use (the engine's
    per-request state files between capture and read)."""

    def __init__(self, folder: Path, every: float = 0.02):
        self.folder, self.every, self.peak = Path(folder), every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="disk-peak", daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            size = 0
            for f in list(self.folder.glob("*")):
                try:
                    size += f.stat().st_size
                except FileNotFoundError:  # read and deleted meanwhile
                    pass
            self.peak = max(self.peak, size)
            self._stop.wait(self.every)

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def disk_bound(concurrency: int, longest: int, n_ids: int, hidden_size: int,
               dtype: torch.dtype) -> int:
    """The most bytes of states the engine's files hold at once: `concurrency` requests of the
    longest sample, each file (n, ids, H) in the target's dtype plus its token ids."""
    return concurrency * longest * (n_ids * hidden_size * dtype.itemsize + 8)


def trainer_bytes(batch_tokens: int, ttt_steps: int, hidden_size: int, n_aux: int,
                  vocab_size: int, draft_vocab: int, held_tokens: int, held_bytes: int,
                  device: str) -> dict[str, int]:
    """The trainer's memory beside the engine, estimated, per device type: the states it holds
    (`held_tokens`: the steps fetched ahead, the one being built and the one training, and the
    evaluation samples, held all run) on the host; the target's embedding and lm_head, the
    drafter (a decoder layer of about 12 H^2, fc, its lm_head) with gradients and AdamW's
    two moments in fp32, and activations where it trains: about 7 x ttt_steps fp32 values of
    width H a token, from the H200's 8B-shape peaks (21.6 GB at T=2,048, 32.6 GB at 16,384)."""
    states = held_tokens * (n_aux + 1) * hidden_size * held_bytes
    head = 2 * vocab_size * hidden_size * 4
    drafter = 16 * ((12 + n_aux) * hidden_size + draft_vocab) * hidden_size
    activations = batch_tokens * ttt_steps * 7 * hidden_size * 4
    model = head + drafter + activations
    return {"cpu": states + model} if device == "cpu" else {"cpu": states, device: model}
