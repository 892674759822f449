"""Hidden stage: run the target over the tokenized data and keep what drafter training needs.

Per token: the aux hidden states (the residual stream ENTERING each of `aux_layers`, before any
norm: what vLLM's `aux_hidden_states` collects, `hidden_states + residual` before layer k) and
the final hidden state after the final norm (the target's logits are `final @ lm_head.T`, so
training gets the target's distribution without storing V floats a token).

Captured with forward pre-hooks on the decoder layers, so any decoder-only HF architecture
works (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3 with MLA...). Stored packed (no padding) in
safetensors shards with a manifest; finished shards survive an interruption and are reused
when the stage restarts with the same inputs (`resume.json` pins them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from draftsmith.artifacts import HIDDEN_MANIFEST, read_hidden_manifest
from draftsmith.atomic import write_json
from draftsmith.config import HiddenConfig, check_aux_layers
from draftsmith.artifacts import TOKENIZED_MANIFEST
from draftsmith.artifacts import iter_samples

RESUME = "resume.json"


def decoder_layers(model) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers")
    return layers


@torch.no_grad()
def capture(model, input_ids, attention_mask, aux_layers: list[int], **decoder_kwargs):
    """-> aux (B, T, len(aux_layers) * H) entering those layers, final (B, T, H) after the
    final norm. decoder_kwargs go to the decoder (a KV cache, for the speculative engine)."""
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
    return torch.cat([seen[k] for k in aux_layers], -1), out.last_hidden_state


def _resume_key(tokenized_dir: Path, cfg: HiddenConfig, layers: list[int], target_rev: str) -> str:
    h = hashlib.sha256((Path(tokenized_dir) / TOKENIZED_MANIFEST).read_bytes())
    h.update(json.dumps([layers, cfg.dtype, cfg.shard_samples, target_rev]).encode())
    return h.hexdigest()[:16]


def _groups(tokenized_dir: Path, size: int) -> Iterator[list]:
    group = []
    for sample in iter_samples(tokenized_dir):
        group.append(sample)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _shard(model, samples, layers, batch_size: int, dtype, pad_id: int) -> dict:
    """Run one shard's samples in length-sorted batches; pack the real tokens only."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][1]))
    aux_out: list = [None] * len(samples)
    fin_out: list = [None] * len(samples)
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        width = max(len(samples[i][1]) for i in idx)
        ids = torch.full((len(idx), width), pad_id)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            n = len(samples[i][1])
            ids[r, :n], att[r, :n] = samples[i][1], 1
        aux, fin = capture(model, ids.to(model.device), att.to(model.device), layers)
        for r, i in enumerate(idx):
            n = len(samples[i][1])
            aux_out[i], fin_out[i] = aux[r, :n].to("cpu", dtype), fin[r, :n].to("cpu", dtype)
    lengths = torch.tensor([0] + [len(s[1]) for s in samples])
    return {
        "aux": torch.cat(aux_out), "final": torch.cat(fin_out),
        "input_ids": torch.cat([s[1] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s[2] for s in samples]).to(torch.uint8),
        "cu_seqlens": torch.cumsum(lengths, 0),
    }


def run(cfg: HiddenConfig, target_dir: Path, tokenized_dir: Path, out_dir: Path) -> dict:
    from draftsmith.target_info import load_model, load_tokenizer, read_info

    info = read_info(target_dir)
    layers = check_aux_layers(cfg, info.num_layers)  # before loading anything big
    model = load_model(target_dir)
    pad_id = load_tokenizer(target_dir).pad_token_id or 0
    return write_hidden(cfg, model, layers, tokenized_dir, out_dir, info.revision or "", pad_id)


def write_hidden(cfg: HiddenConfig, model, layers: list[int], tokenized_dir: Path, out_dir: Path,
                 target_revision: str, pad_id: int) -> dict:
    dtype = getattr(torch, cfg.dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = _resume_key(tokenized_dir, cfg, layers, target_revision)
    resume = out_dir / RESUME
    if not (resume.exists() and json.loads(resume.read_text())["key"] == key):
        for f in out_dir.glob("*") if out_dir.exists() else []:
            f.unlink()  # a different run's shards: start clean
        write_json(resume, {"key": key})
    shards, reused, tokens = [], 0, 0
    tokenized = json.loads((Path(tokenized_dir) / TOKENIZED_MANIFEST).read_text())
    total = sum(len(s["ids"]) for s in tokenized["shards"])
    bar = tqdm(total=total, desc="hidden", unit="sample")
    for s, group in enumerate(_groups(tokenized_dir, cfg.shard_samples)):
        name = f"hidden-{s:05d}.safetensors"
        if (out_dir / name).exists():
            reused += 1  # written whole by an earlier, interrupted run (write-then-rename)
        else:
            tensors = _shard(model, group, layers, cfg.batch_size, dtype, pad_id)
            tmp = out_dir / f".{name}.tmp"
            save_file(tensors, tmp)
            tmp.rename(out_dir / name)
        shards.append({"file": name, "ids": [g[0] for g in group],
                       "lengths": [len(g[1]) for g in group]})
        tokens += sum(len(g[1]) for g in group)
        bar.update(len(group))
    bar.close()
    hidden_size = model.config.get_text_config().hidden_size
    write_json(out_dir / HIDDEN_MANIFEST, {"aux_layers": layers, "hidden_size": hidden_size,
                                    "dtype": cfg.dtype, "shards": shards})
    per_token = (len(layers) + 1) * hidden_size * torch.finfo(dtype).bits // 8
    return {"aux_layers": layers, "samples": total, "tokens": tokens, "shards": len(shards),
            "reused_shards": reused, "bytes_per_token": per_token,
            "bytes": per_token * tokens}


def iter_hidden(hidden_dir: Path):
    """Yield (sample_id, aux, final, input_ids, loss_mask) per sample."""
    for shard in read_hidden_manifest(hidden_dir)["shards"]:
        t = load_file(Path(hidden_dir) / shard["file"])
        cu = t["cu_seqlens"].tolist()
        for k, sid in enumerate(shard["ids"]):
            a, b = cu[k], cu[k + 1]
            yield (sid, t["aux"][a:b], t["final"][a:b], t["input_ids"][a:b].long(),
                   t["loss_mask"][a:b].bool())
