"""Hidden stage: run the target over the tokenized data and store what drafter training needs.

What is stored per token (the aux states entering `aux_layers` and the final hidden state) and
how it is captured: capture.py; the artifact's format and readers: hidden_format.py. This module
plans the rows and shards, runs the extraction and writes the shards.

Extraction packs samples end to end into rows of `row_tokens` (longest first, first fit), with
positions that restart per sample, so no compute goes to padding and no sample sees another
(capture.capture_rows). Each forward's real tokens are gathered on the device, cast (or
fp8-quantized, per token and layer, by draftsmith_kernels.fp8_rows) there, and copied into
pinned host memory on a side stream; writer threads save finished shards straight from that
memory, hashing them as they go (write, then rename), while the GPU runs the next. Shards are
sized in bytes (`shard_mb`); finished shards survive an interruption and are reused when the
stage restarts with the same inputs (`resume.json` pins them).

Under torchrun each process extracts every world-size-th shard; the first writes the manifest.
`mode: online` stores nothing: the train stage runs the target itself (`capture_rows`), or
with `engine: vllm` fetches the states from a server as it trains (train/engine_feed.py).

`engine: vllm` runs the target in a vLLM server instead (serving/hidden_states.py: a 1T INT4
MoE under tensor/expert parallelism) and writes the same shards and manifest from its states.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.artifacts import TOKENIZED_MANIFEST, iter_samples, sample_lengths
from draftsmith.atomic import atomic_path, file_sha256, write_json
from draftsmith.capture import capture_flat, capture_rows, is_varlen, set_attention
from draftsmith.config import HiddenConfig, ServerConfig, check_aux_layers
from draftsmith.errors import DraftsmithError
from draftsmith.hidden.fused_forward import fused
from draftsmith.hidden_format import (FP8, HIDDEN_MANIFEST, empty_states, encode, kept_key,
                                      offline_manifest, online_manifest, sample_tensors,
                                      shard_entry, shard_file, token_bytes)
from draftsmith.packing import first_fit

RESUME = "resume.json"
# Shards written at once, each by its own thread (write and sha256 release the GIL). On an
# H200 host 4 threads write 4.4-4.8 GB/s, an 8B extraction makes 1.1 GB/s, and it runs as fast
# with the writes as without (benchmarks/results/hidden_extract_h200_576.json).
WRITERS = 4


# ----------------------------------------------------------------------------- planning


def pack_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Sample indices into rows of at most row_tokens tokens, longest first (first fit); a
    sample longer than a row gets a row of its own."""
    return first_fit(sorted(range(len(lengths)), key=lambda i: -lengths[i]), lengths, row_tokens)


def plan_forwards(rows: list[list[int]], lengths: list[int], row_tokens: int,
                  batch_rows: int) -> list[list[list[int]]]:
    """Rows into forward passes of up to batch_rows rows. A row longer than row_tokens (one
    sample longer than a row) is a forward of its own: beside it, padded rows would all be
    padded to its length, and even a flat row would hold batch_rows rows' activations on top
    of the longest sample's. So a forward holds at most max(row_tokens x batch_rows, the
    longest sample) tokens."""
    forwards: list[list[list[int]]] = []
    filling: list[list[int]] | None = None  # the forward taking rows, in order
    for row in rows:
        if sum(lengths[i] for i in row) > row_tokens:
            forwards.append([row])
            filling = None
            continue
        if filling is None or len(filling) == batch_rows:
            filling = []
            forwards.append(filling)
        filling.append(row)
    return forwards


def check_window(lengths: dict, window: int | None) -> None:
    """Samples longer than the target's context window are refused before any work: the target
    was never run at those positions, so their states would be what a drafter learns from."""
    long = {s: n for s, n in lengths.items() if window and n > window}
    if long:
        sid, n = max(long.items(), key=lambda kv: kv[1])
        raise DraftsmithError(
            f"{len(long)} sample(s) are longer than the target's context window of {window} "
            f"tokens (the longest: sample {sid}, {n} tokens)",
            f"set tokenize.max_length to at most {window} and rerun tokenize")


def plan_shards(lengths: list[int], token_bytes: int, shard_bytes: int) -> list[range]:
    """Consecutive samples into shards of at most shard_bytes (at least one sample each)."""
    shards, start, size = [], 0, 0
    for i, n in enumerate(lengths):
        if size and size + n * token_bytes > shard_bytes:
            shards.append(range(start, i))
            start, size = i, 0
        size += n * token_bytes
    if start < len(lengths):
        shards.append(range(start, len(lengths)))
    return shards


# ----------------------------------------------------------------------------- extraction


class _HostShard:
    """One shard's states in (pinned, on CUDA) host memory, filled by side-stream copies."""

    def __init__(self, tokens: int, n_layers: int, H: int, cfg: HiddenConfig, device):
        pin = device.type == "cuda"
        self.dtype, self.n_layers = cfg.dtype, n_layers
        self.t = empty_states(tokens, n_layers, H, cfg.dtype, pin)
        self.stream = torch.cuda.Stream(device) if pin else None

    def put(self, at: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        """aux (n, L*H), final (n, H) on the device -> rows at..at+n, converted there."""
        n = len(aux)
        quantize = None
        if self.dtype == FP8:
            from draftsmith_kernels.fp8_rows import quantize
        parts = encode(aux, final, self.dtype, self.n_layers, quantize)
        if self.stream is None:
            for k, v in parts.items():
                self.t[k][at:at + n].copy_(v)
            return
        self.stream.wait_stream(torch.cuda.current_stream(aux.device))
        with torch.cuda.stream(self.stream):
            for k, v in parts.items():
                self.t[k][at:at + n].copy_(v, non_blocking=True)
                v.record_stream(self.stream)

    def done(self):
        """-> the tensors and, on CUDA, an event the copies into them complete at: the writer
        waits on it, so the thread feeding the GPU goes straight on to the next shard."""
        if self.stream is None:
            return self.t, None
        ready = torch.cuda.Event()
        ready.record(self.stream)
        return self.t, ready


def _extract_shard(model, samples: list, layers: list[int], cfg: HiddenConfig, pad_id: int):
    """-> the shard's host tensors, its samples in their stored order (_stored_order), and the
    event its device-to-host copies complete at (None on a CPU)."""
    H = model.config.get_text_config().hidden_size
    device = model.device
    lengths = [len(s[1]) for s in samples]
    rows = pack_rows(lengths, cfg.row_tokens)
    host = _HostShard(sum(lengths), len(layers), H, cfg, device)
    at = 0
    for batch in plan_forwards(rows, lengths, cfg.row_tokens, cfg.batch_rows):
        if is_varlen(model):  # the rows' samples as one flat row: nothing padded
            aux, fin = capture_flat(model, [samples[i][1] for row in batch for i in row], layers)
            host.put(at, aux, fin)
            at += len(aux)
            continue
        width = max(cfg.row_tokens, *(sum(lengths[i] for i in row) for row in batch))
        ids = torch.full((len(batch), width), pad_id)
        pos = torch.zeros((len(batch), width), dtype=torch.long)
        keep = torch.zeros((len(batch), width), dtype=torch.bool)
        for r, row in enumerate(batch):
            c = 0
            for i in row:
                n = lengths[i]
                ids[r, c:c + n], pos[r, c:c + n] = samples[i][1], torch.arange(n)
                c += n
            keep[r, :c] = True
            pos[r, c:] = torch.arange(width - c)  # the padding: one more "sample"
        aux, fin = capture_rows(model, ids.to(device), pos.to(device), layers)
        sel = keep.view(-1).nonzero()[:, 0].to(aux.device)
        n = len(sel)
        host.put(at, aux.reshape(-1, aux.shape[-1]).index_select(0, sel),
                 fin.reshape(-1, H).index_select(0, sel))
        at += n
    ordered = [samples[i] for row in rows for i in row]  # as _stored_order
    tensors, ready = host.done()
    tensors.update(sample_tensors(ordered))
    return tensors, ready


def _served_shard(client, samples: list, n_layers: int, hidden_size: int, cfg: HiddenConfig):
    """hidden.engine: vllm: the shard's states from the server, stored as _extract_shard's."""
    ordered = _stored_order(samples, cfg.row_tokens)
    got = client.states_of([(s[0], s[1]) for s in ordered])
    host = _HostShard(sum(len(s[1]) for s in ordered), n_layers, hidden_size, cfg,
                      torch.device("cpu"))
    host.put(0, torch.cat([got[s[0]][0] for s in ordered]),
             torch.cat([got[s[0]][1] for s in ordered]))
    tensors, ready = host.done()
    tensors.update(sample_tensors(ordered))
    return tensors, ready


def _write_shard(tensors: dict, ready, path: Path) -> dict:
    """In a writer thread: wait for the shard's copies to land (`ready`), then save it."""
    if ready is not None:
        ready.synchronize()
    return _save(tensors, path)


def _save(tensors: dict, path: Path) -> dict:
    """Write then rename; -> the shard's size and sha256 (computed while writing), for the
    manifest. A full disk leaves no partial file and says so."""
    from draftsmith.hidden.safetensors_write import save_hashed

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        digest = save_hashed(tensors, tmp)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise DraftsmithError(
                f"no space left on the device holding {path.parent} while writing {path.name}",
                "free space there (a shard is about hidden.shard_mb MiB; hidden.dtype: "
                "float8_e4m3fn halves them, hidden.mode: online stores none); rerunning the "
                "stage keeps the shards already written") from e
        raise
    tmp.rename(path)
    return digest


def _digest(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def _resume_key(tokenized_dir: Path, cfg: HiddenConfig, layers: list[int], target_rev: str) -> str:
    h = hashlib.sha256((Path(tokenized_dir) / TOKENIZED_MANIFEST).read_bytes())
    h.update(json.dumps([layers, cfg.dtype, cfg.shard_mb, cfg.row_tokens, target_rev,
                         cfg.engine, code_fingerprint()]).encode())
    return h.hexdigest()[:16]


def code_fingerprint() -> str:
    """What computes the states: this module, the capture, attention and fusion code, torch's
    and transformers' versions. A rerun after any of them changed (a fix in the capture, an
    upgrade) recomputes every shard instead of reusing those of the earlier run."""
    import sys

    import transformers

    from draftsmith import capture, hidden_format, packed_attention
    from draftsmith.hidden import fused_forward

    h = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for module in (sys.modules[__name__], capture, packed_attention, fused_forward, hidden_format):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:16]


def run(cfg: HiddenConfig, target_dir: Path, tokenized_dir: Path, out_dir: Path,
        server: ServerConfig | None = None, work_dir: Path | None = None) -> dict:
    """Under torchrun every process takes every world-size-th shard (data parallel). With
    hidden.engine: vllm a vLLM server runs the target (`server`: launched, its log and files
    in work_dir, or server.urls)."""
    from draftsmith.dist import world
    from draftsmith.target_info import (context_length, default_device, load_model,
                                        load_tokenizer, read_info)

    w = world()
    info = read_info(target_dir)
    layers = check_aux_layers(cfg, info.num_layers)  # before loading anything big
    if cfg.mode == "online":
        if cfg.engine == "vllm":  # what the engine cannot capture: refused now, not in train
            from draftsmith.serving.hidden_states import check_capture
            from draftsmith.target_info import load_final_norm

            check_capture(load_final_norm(target_dir)[1].model_type, layers)
        return write_online_manifest(layers, info.hidden_size, out_dir, cfg.engine,
                                     cfg.dtype) if w.main else {}
    lengths = sample_lengths(tokenized_dir)
    check_window(lengths, context_length(target_dir))  # before loading or serving the target
    if cfg.kept_from and w.main:
        adopted = adopt_kept(Path(cfg.kept_from), cfg,
                             kept_key(target_dir, tokenized_dir, layers, cfg.dtype), lengths,
                             out_dir)
        if adopted:
            return adopted
    if cfg.engine == "vllm":
        out_dir = Path(out_dir)
        return write_hidden_served(cfg, server or ServerConfig(), target_dir, tokenized_dir,
                                   out_dir, work_dir or out_dir.with_name(out_dir.name + ".work"),
                                   layers, lengths, info.revision or "")
    if cfg.device_map and w.size > 1:
        raise DraftsmithError(
            "hidden.device_map: auto spreads one target over all visible GPUs, so it runs as "
            f"one process, not {w.size}", "set distributed.nproc_per_node: 1 for a target "
            "larger than one GPU, or hidden.device_map: null for one target copy per GPU")
    model = load_model(target_dir, device=str(w.device(default_device())),
                       device_map=cfg.device_map)
    set_attention(model, cfg.attention)
    pad_id = load_tokenizer(target_dir).pad_token_id or 0
    with fused(model):  # norms, SiLU-MLPs, rotary as single kernels (a GPU with Triton)
        return write_hidden(cfg, model, layers, tokenized_dir, out_dir, info.revision or "",
                            pad_id, w)


def adopt_kept(kept_dir: Path, cfg: HiddenConfig, key: str, lengths: dict[str, int],
               out_dir: Path) -> dict | None:
    """hidden.kept_from: the states an online run kept (hidden.online_keep) become this stage's
    artifact, no engine started, when they are what capturing would write: kept for these
    samples, target, layers and dtype, and captured by the engine asked for (vLLM's capture
    gives the same states bit for bit, tests/test_hidden_vllm.py). Shards are copied and
    checked against their sha256. -> the stage's metrics, or None (the reason printed)."""
    index = kept_dir / HIDDEN_MANIFEST
    kept = json.loads(index.read_text()) if index.exists() else {}
    ids = {i for s in kept.get("shards", []) for i in s["ids"]}
    why = ("it holds no kept states" if not kept else
           f"hidden.engine is {cfg.engine}; kept states are vLLM's" if cfg.engine != "vllm" else
           "they were kept for other samples, target, layers or dtype" if kept.get("key") != key
           or kept["dtype"] != cfg.dtype else
           f"it holds {len(ids & lengths.keys())} of the {len(lengths)} samples"
           if ids != lengths.keys() else "")
    if why:
        print(f"hidden: not taking the states kept in {kept_dir}: {why}; capturing them")
        return None
    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for shard in tqdm(kept["shards"], desc="hidden: kept shards", unit="shard"):
            shutil.copyfile(kept_dir / shard["file"], tmp / shard["file"])
            if _digest(tmp / shard["file"]) != {k: shard[k] for k in ("bytes", "sha256")}:
                raise DraftsmithError(
                    f"kept shard {kept_dir / shard['file']} does not match its sha256 in "
                    f"{index}", f"delete {kept_dir} (or unset hidden.kept_from) to capture again")
        write_json(tmp / HIDDEN_MANIFEST, offline_manifest(
            kept["aux_layers"], kept["hidden_size"], kept["dtype"], kept["shards"]))
    tokens = sum(lengths.values())
    per_token = token_bytes(cfg.dtype, len(kept["aux_layers"]), kept["hidden_size"])
    return {"mode": "offline", "engine": cfg.engine, "aux_layers": kept["aux_layers"],
            "samples": len(lengths), "tokens": tokens, "shards": len(kept["shards"]),
            "reused_shards": 0, "adopted_kept_shards": len(kept["shards"]),
            "dtype": cfg.dtype, "bytes_per_token": per_token, "bytes": per_token * tokens,
            "processes": 1}


def write_online_manifest(layers: list[int], hidden_size: int, out_dir: Path,
                          engine: str = "hf", dtype: str = "bfloat16") -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("*"):
        f.unlink()
    write_json(out_dir / HIDDEN_MANIFEST, online_manifest(layers, hidden_size, engine, dtype))
    return {"mode": "online", "engine": engine, "aux_layers": layers, "bytes": 0}


def _prepare_out(out_dir: Path, key: str) -> None:
    """Keep the shards of an interrupted run with the same inputs (resume.json says which
    run), drop anything else and any half-written shard."""
    out_dir.mkdir(parents=True, exist_ok=True)
    resume = out_dir / RESUME
    if not (resume.exists() and json.loads(resume.read_text())["key"] == key):
        for f in out_dir.glob("*"):
            f.unlink()  # a different run's shards: start clean
        write_json(resume, {"key": key})
    for f in out_dir.glob(".*.tmp"):
        f.unlink()  # a shard half-written when the last run was killed


def _stored_order(group: list, row_tokens: int) -> list:
    """A shard's samples in the order extraction stores them (its packed rows, in turn)."""
    rows = pack_rows([len(g[1]) for g in group], row_tokens)
    return [group[i] for row in rows for i in row]


def write_hidden_served(cfg: HiddenConfig, server: ServerConfig, target_dir: Path,
                        tokenized_dir: Path, out_dir: Path, work_dir: Path, layers: list[int],
                        lengths: dict[str, int], target_revision: str) -> dict:
    """hidden.engine: vllm: the same artifact as write_hidden's, the states from vLLM's capture
    (serving/hidden_states.py). The engine spreads the target itself (tensor/expert parallel):
    this is one process, which only sends requests and writes shards."""
    from draftsmith.serving import hidden_states as engine
    from draftsmith.serving.memory import MiB, EngineNeed
    from draftsmith.target_info import load_final_norm

    norm, config = load_final_norm(target_dir)
    engine.check_capture(config.model_type, layers)
    states = engine.EngineStates(layers, config.num_hidden_layers, norm, config.rms_norm_eps)
    # The stage holds at most WRITERS + 1 shards and the one it gathers.
    need = EngineNeed("hidden", max(lengths.values()) + 1,
                      {"cpu": int((WRITERS + 2) * cfg.shard_mb * MiB)},
                      f"{WRITERS + 2} shards of hidden.shard_mb={cfg.shard_mb}")
    with engine.served_capture(server, target_dir, work_dir, states, need=need) as client:
        engine.check_lengths(lengths, client.max_model_len, "the server")
        return _write_shards(
            cfg, lambda group: _served_shard(client, group, len(layers), config.hidden_size, cfg),
            config.hidden_size, layers, tokenized_dir, out_dir, target_revision)


def write_hidden(cfg: HiddenConfig, model, layers: list[int], tokenized_dir: Path, out_dir: Path,
                 target_revision: str, pad_id: int, w=None) -> dict:
    """w: this process's place in a torchrun world (dist.World; None = the only process). Each
    process writes its own shards; the main one then writes the manifest for all."""
    return _write_shards(cfg, lambda group: _extract_shard(model, group, layers, cfg, pad_id),
                         model.config.get_text_config().hidden_size, layers, tokenized_dir,
                         out_dir, target_revision, w)


def _write_shards(cfg: HiddenConfig, extract, hidden_size: int, layers: list[int],
                  tokenized_dir: Path, out_dir: Path, target_revision: str, w=None) -> dict:
    """extract(a shard's samples) -> (its tensors, the event their copies complete at)."""
    from draftsmith.dist import World

    w = w or World()
    out_dir = Path(out_dir)
    if w.main:
        _prepare_out(out_dir, _resume_key(tokenized_dir, cfg, layers, target_revision))
    w.barrier()
    per_token = token_bytes(cfg.dtype, len(layers), hidden_size)
    samples = list(iter_samples(tokenized_dir))
    plan = plan_shards([len(s[1]) for s in samples], per_token, int(cfg.shard_mb * 2**20))
    mine = [s for s in range(len(plan)) if s % w.size == w.rank]
    digests, reused, pending = {}, 0, []  # pending: (shard, the writer's future)
    bar = tqdm(total=sum(len(samples[i][1]) for s in mine for i in plan[s]), desc="hidden",
               unit="tok", unit_scale=True, disable=not w.main)
    with ThreadPoolExecutor(max_workers=WRITERS) as writer:  # the disk never stalls the GPU
        for s in mine:
            path = out_dir / shard_file(s)
            group = [samples[i] for i in plan[s]]
            if path.exists():
                reused += 1  # written whole by an earlier, interrupted run (write-then-rename)
                future = writer.submit(_digest, path)
            else:
                future = writer.submit(_write_shard, *extract(group), path)
            pending.append((s, future))
            if len(pending) > WRITERS:  # at most WRITERS + 1 shards in host memory
                done, future = pending.pop(0)
                digests[done] = future.result()
            bar.update(sum(len(g[1]) for g in group))
        for done, future in pending:
            digests[done] = future.result()
    bar.close()
    parts = w.gather((digests, reused))
    if not w.main:
        return {}
    for d, _ in parts:
        digests.update(d)
    shards = []
    for s, members in enumerate(plan):
        ordered = _stored_order([samples[i] for i in members], cfg.row_tokens)  # deterministic
        shards.append(shard_entry(s, [g[0] for g in ordered], [len(g[1]) for g in ordered],
                                  digests[s]))
    write_json(out_dir / HIDDEN_MANIFEST, offline_manifest(layers, hidden_size, cfg.dtype,
                                                           shards))
    tokens = sum(len(s[1]) for s in samples)
    return {"mode": "offline", "engine": cfg.engine, "aux_layers": layers,
            "samples": len(samples), "tokens": tokens,
            "shards": len(shards), "reused_shards": sum(r for _, r in parts), "dtype": cfg.dtype,
            "bytes_per_token": per_token, "bytes": per_token * tokens, "processes": w.size}
