"""Hidden stage: run the target over the tokenized data and keep what drafter training needs.

Per token: the aux hidden states (the residual stream ENTERING each of `aux_layers`, before any
norm: what vLLM's `aux_hidden_states` collects, `hidden_states + residual` before layer k) and
the final hidden state after the final norm (the target's logits are `final @ lm_head.T`, so
training gets the target's distribution without storing V floats a token).

Captured with forward pre-hooks on the decoder layers, so any decoder-only HF architecture
works (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3 with MLA...).

Extraction packs samples end to end into rows of `row_tokens` (longest first, first fit), with
positions that restart per sample: transformers turns such position ids into a block-diagonal
causal mask (flex attention on a GPU skips the masked blocks; SDPA masks them), so no compute
goes to padding and no sample sees another. Each forward's real tokens are gathered on the
device, cast (or fp8-quantized, per token and layer, by draftsmith_kernels.fp8_rows) there,
and copied into pinned host memory on a side stream; writer threads save finished shards
straight from that memory, hashing them as they go (write, then rename), while the GPU runs
the next. Shards are sized in bytes (`shard_mb`); finished shards survive an interruption and
are reused when the stage restarts with the same inputs (`resume.json` pins them).

Under torchrun each process extracts every world-size-th shard; the first writes the manifest.
`mode: online` stores nothing: the train stage runs the target itself (`capture_rows`).
"""

from __future__ import annotations

import errno
import hashlib
import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from draftsmith.artifacts import (HIDDEN_MANIFEST, TOKENIZED_MANIFEST, iter_samples,
                                  read_hidden_manifest)
from draftsmith.atomic import file_sha256, write_json
from draftsmith.config import HiddenConfig, check_aux_layers
from draftsmith import packed_attention
from draftsmith.errors import DraftsmithError
from draftsmith.packing import first_fit

RESUME = "resume.json"
# Shards written at once, each by its own thread (write and sha256 release the GIL). On an
# H200 host 4 threads write 4.4-4.8 GB/s, an 8B extraction makes 1.1 GB/s, and it runs as fast
# with the writes as without (benchmarks/results/hidden_extract_h200_576.json).
WRITERS = 4
FP8 = "float8_e4m3fn"
STATE_KEYS = ("aux", "final", "aux_scale", "final_scale")  # the last two in fp8 shards only


def decoder_layers(model) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers")
    return layers


@torch.no_grad()
def capture(model, input_ids, attention_mask, aux_layers: list[int], **decoder_kwargs):
    """-> aux (B, T, len(aux_layers) * H) entering those layers, final (B, T, H) after the
    final norm. decoder_kwargs go to the decoder (position ids, a KV cache)."""
    layers = decoder_layers(model)
    seen: dict[int, torch.Tensor] = {}

    def hook(k):
        def pre(_module, args, kwargs):
            seen[k] = args[0] if args else kwargs["hidden_states"]
        return pre

    handles = [layers[k].register_forward_pre_hook(hook(k), with_kwargs=True) for k in aux_layers]
    try:
        out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                  **{"use_cache": False, **decoder_kwargs})
    finally:
        for h in handles:
            h.remove()
    final = out.last_hidden_state
    # With a device map the layers sit on several GPUs: gather on the last one.
    return torch.cat([seen[k].to(final.device) for k in aux_layers], -1), final


def capture_rows(model, ids, pos, aux_layers: list[int]):
    """Packed rows: ids and pos (B, T), pos restarting at 0 for each sample (and for the
    padding at a row's end). -> aux, final as `capture`, each token seeing its own sample only."""
    if not is_varlen(model):
        return capture(model, ids, None, aux_layers, position_ids=pos)
    B, T = ids.shape
    starts = (pos.reshape(-1) == 0).nonzero()[:, 0].tolist()  # where samples start: one sync
    lengths = [b - a for a, b in zip(starts, [*starts[1:], B * T])]
    with packed_attention.documents(lengths, ids.device):
        aux, final = capture(model, ids.reshape(1, -1), None, aux_layers,
                             position_ids=pos.reshape(1, -1))
    return aux.view(B, T, -1), final.view(B, T, -1)


def capture_flat(model, seqs: list[torch.Tensor], aux_layers: list[int]):
    """Samples end to end in one row, no padding (a model set to packed_attention.NAME).
    -> aux (n, L*H), final (n, H) for their n tokens, in order."""
    device = model.device
    lengths = [len(s) for s in seqs]
    ids = torch.cat(seqs)[None].to(device, non_blocking=True)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device, non_blocking=True)
    with packed_attention.documents(lengths, device):
        aux, final = capture(model, ids, None, aux_layers, position_ids=pos)
    return aux[0], final[0]


def is_varlen(model) -> bool:
    return model.config._attn_implementation == packed_attention.NAME


# ----------------------------------------------------------------------------- planning


def pack_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Sample indices into rows of at most row_tokens tokens, longest first (first fit); a
    sample longer than a row gets a row of its own."""
    return first_fit(sorted(range(len(lengths)), key=lambda i: -lengths[i]), lengths, row_tokens)


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


def token_bytes(cfg: HiddenConfig, n_layers: int, hidden_size: int) -> int:
    """Stored bytes of one token's states, scales included."""
    if cfg.dtype == FP8:
        return (n_layers + 1) * (hidden_size + 4)  # fp8 values + one fp32 scale a row
    return (n_layers + 1) * hidden_size * torch.finfo(getattr(torch, cfg.dtype)).bits // 8


# ----------------------------------------------------------------------------- extraction


class _HostShard:
    """One shard's states in (pinned, on CUDA) host memory, filled by side-stream copies."""

    def __init__(self, tokens: int, n_layers: int, H: int, cfg: HiddenConfig, device):
        pin = device.type == "cuda"
        store = torch.float8_e4m3fn if cfg.dtype == FP8 else getattr(torch, cfg.dtype)
        self.fp8, self.n_layers = cfg.dtype == FP8, n_layers
        self.t = {"aux": torch.empty(tokens, n_layers * H, dtype=store, pin_memory=pin),
                  "final": torch.empty(tokens, H, dtype=store, pin_memory=pin)}
        if self.fp8:
            self.t["aux_scale"] = torch.empty(tokens, n_layers, pin_memory=pin)
            self.t["final_scale"] = torch.empty(tokens, 1, pin_memory=pin)
        self.stream = torch.cuda.Stream(device) if pin else None

    def put(self, at: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        """aux (n, L*H), final (n, H) on the device -> rows at..at+n, converted there."""
        n = len(aux)
        if self.fp8:
            from draftsmith_kernels.fp8_rows import quantize

            qa, sa = quantize(aux.reshape(n * self.n_layers, -1))
            qf, sf = quantize(final)
            parts = {"aux": qa.view(n, -1), "aux_scale": sa.view(n, -1), "final": qf,
                     "final_scale": sf.view(n, 1)}
        else:
            parts = {"aux": aux.to(self.t["aux"].dtype), "final": final.to(self.t["final"].dtype)}
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
    for b in range(0, len(rows), cfg.batch_rows):
        batch = rows[b:b + cfg.batch_rows]
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
    tensors.update({
        "input_ids": torch.cat([s[1] for s in ordered]).to(torch.int32),
        "loss_mask": torch.cat([s[2] for s in ordered]).to(torch.uint8),
        "cu_seqlens": torch.cumsum(torch.tensor([0] + [len(s[1]) for s in ordered]), 0),
    })
    return tensors, ready


def _write_shard(tensors: dict, ready, path: Path) -> dict:
    """In a writer thread: wait for the shard's copies to land (`ready`), then save it."""
    if ready is not None:
        ready.synchronize()
    return _save(tensors, path)


def _save(tensors: dict, path: Path) -> dict:
    """Write then rename; -> the shard's size and sha256 (computed while writing), for the
    manifest. A full disk leaves no partial file and says so."""
    from draftsmith.safetensors_write import save_hashed

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
    h.update(json.dumps([layers, cfg.dtype, cfg.shard_mb, cfg.row_tokens, target_rev]).encode())
    return h.hexdigest()[:16]


def run(cfg: HiddenConfig, target_dir: Path, tokenized_dir: Path, out_dir: Path) -> dict:
    """Under torchrun every process takes every world-size-th shard (data parallel)."""
    from draftsmith.dist import world
    from draftsmith.target_info import default_device, load_model, load_tokenizer, read_info

    w = world()
    info = read_info(target_dir)
    layers = check_aux_layers(cfg, info.num_layers)  # before loading anything big
    if cfg.mode == "online":
        return write_online_manifest(layers, info.hidden_size, out_dir) if w.main else {}
    if cfg.device_map and w.size > 1:
        raise DraftsmithError(
            "hidden.device_map: auto spreads one target over all visible GPUs, so it runs as "
            f"one process, not {w.size}", "set distributed.nproc_per_node: 1 for a target "
            "larger than one GPU, or hidden.device_map: null for one target copy per GPU")
    model = load_model(target_dir, device=str(w.device(default_device())),
                       device_map=cfg.device_map)
    set_attention(model, cfg.attention)
    pad_id = load_tokenizer(target_dir).pad_token_id or 0
    return write_hidden(cfg, model, layers, tokenized_dir, out_dir, info.revision or "", pad_id,
                        w)


def set_attention(model, attention: str) -> None:
    """auto: on a GPU the packed varlen attention (packed_attention: one flat row, flash
    attention per sample) for a bf16/fp16 target, flex attention (masked blocks skipped) for
    an fp32 one; SDPA on a CPU."""
    if attention == "auto":
        if model.device.type != "cuda":
            attention = "sdpa"
        else:
            attention = "varlen" if packed_attention.varlen_available(model.device, model.dtype) \
                else "flex_attention"
    if attention == "varlen":
        attention = packed_attention.register()
    model.set_attn_implementation(attention)


def write_online_manifest(layers: list[int], hidden_size: int, out_dir: Path) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("*"):
        f.unlink()
    write_json(out_dir / HIDDEN_MANIFEST, {"mode": "online", "aux_layers": layers,
                                           "hidden_size": hidden_size, "shards": []})
    return {"mode": "online", "aux_layers": layers, "bytes": 0}


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


def write_hidden(cfg: HiddenConfig, model, layers: list[int], tokenized_dir: Path, out_dir: Path,
                 target_revision: str, pad_id: int, w=None) -> dict:
    """w: this process's place in a torchrun world (dist.World; None = the only process). Each
    process writes its own shards; the main one then writes the manifest for all."""
    from draftsmith.dist import World

    w = w or World()
    out_dir = Path(out_dir)
    if w.main:
        _prepare_out(out_dir, _resume_key(tokenized_dir, cfg, layers, target_revision))
    w.barrier()
    hidden_size = model.config.get_text_config().hidden_size
    per_token = token_bytes(cfg, len(layers), hidden_size)
    samples = list(iter_samples(tokenized_dir))
    plan = plan_shards([len(s[1]) for s in samples], per_token, int(cfg.shard_mb * 2**20))
    mine = [s for s in range(len(plan)) if s % w.size == w.rank]
    digests, reused, pending = {}, 0, []  # pending: (shard, the writer's future)
    bar = tqdm(total=sum(len(samples[i][1]) for s in mine for i in plan[s]), desc="hidden",
               unit="tok", unit_scale=True, disable=not w.main)
    with ThreadPoolExecutor(max_workers=WRITERS) as writer:  # the disk never stalls the GPU
        for s in mine:
            path = out_dir / f"hidden-{s:05d}.safetensors"
            group = [samples[i] for i in plan[s]]
            if path.exists():
                reused += 1  # written whole by an earlier, interrupted run (write-then-rename)
                future = writer.submit(_digest, path)
            else:
                future = writer.submit(_write_shard, *_extract_shard(model, group, layers, cfg,
                                                                     pad_id), path)
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
        shards.append({"file": f"hidden-{s:05d}.safetensors", "ids": [g[0] for g in ordered],
                       "lengths": [len(g[1]) for g in ordered], **digests[s]})
    write_json(out_dir / HIDDEN_MANIFEST, {"mode": "offline", "aux_layers": layers,
                                           "hidden_size": hidden_size, "dtype": cfg.dtype,
                                           "shards": shards})
    tokens = sum(len(s[1]) for s in samples)
    return {"mode": "offline", "aux_layers": layers, "samples": len(samples), "tokens": tokens,
            "shards": len(shards), "reused_shards": sum(r for _, r in parts), "dtype": cfg.dtype,
            "bytes_per_token": per_token, "bytes": per_token * tokens, "processes": w.size}


def iter_hidden(hidden_dir: Path):
    """Yield (sample_id, aux, final, input_ids, loss_mask) per sample, states dequantized."""
    for shard in read_hidden_manifest(hidden_dir)["shards"]:
        t = load_file(Path(hidden_dir) / shard["file"])
        aux, final = hidden_states(t)
        cu = t["cu_seqlens"].tolist()
        for k, sid in enumerate(shard["ids"]):
            a, b = cu[k], cu[k + 1]
            yield (sid, aux[a:b], final[a:b], t["input_ids"][a:b].long(),
                   t["loss_mask"][a:b].bool())


def hidden_states(t: dict, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """A hidden shard's tensors (or slices of them) -> aux (n, L*H), final (n, H); fp8 ones
    (one scale per token and layer) dequantized to dtype, others as stored."""
    if t["aux"].dtype != torch.float8_e4m3fn:
        return t["aux"], t["final"]
    from draftsmith_kernels.fp8_rows import dequantize

    n, layers = t["aux_scale"].shape
    aux = dequantize(t["aux"].reshape(n * layers, -1), t["aux_scale"].reshape(-1), dtype)
    return aux.view(n, -1), dequantize(t["final"], t["final_scale"].reshape(-1), dtype)
