"""The cases the training and extraction benchmarks run, at model shapes (8B, Kimi-K2.5,
Qwen3-8B) and at toy size for the CPU: drafters and batches for train_ttt.py, targets, length
mixes and tokenized artifacts for hidden_extract.py; scale_out.py runs both again under
torchrun."""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch


TRAIN_PRESETS = {
    "8b": dict(H=4096, nh=32, nkv=8, hd=128, I=14336, V=128256, Vd=32000, steps=7,
               lengths=[2048, 8192, 16384, 32768], tokens_per_step=8192, iters=8),
    # Kimi-K2.5's text model (DeepSeek-V3 shape), its config's widths; make_drafter builds
    # from them what the train stage would: `llama` 64 heads of 64 (head_dim, KV heads),
    # `mla` the target's MLA widths; the dense MLP width.
    "kimi-k2": dict(H=7168, nh=64, nkv=64, hd=64, I=18432, V=163840, Vd=32000, steps=7,
                    lengths=[8192, 16384], tokens_per_step=8192, iters=4,
                    mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128)),
    # Qwen3-8B (the methods issue's shape): vocab 151,936, MLP 12,288; DFlash as published
    # (z-lab's Qwen3-8B-DFlash-b16): 5 Qwen3 layers, blocks of 16, 512 anchors a row.
    "qwen3-8b": dict(H=4096, nh=32, nkv=8, hd=128, I=12288, V=151936, Vd=32000, steps=7,
                     lengths=[2048, 16384], tokens_per_step=8192, iters=4,
                     dflash=dict(num_layers=5, block_size=16, anchors=512)),
    "toy": dict(H=64, nh=4, nkv=2, hd=16, I=128, V=512, Vd=128, steps=3,
                lengths=[64, 128], tokens_per_step=256, iters=2,
                mla=dict(q_lora_rank=32, kv_lora_rank=48, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16),
                dflash=dict(num_layers=2, block_size=4, anchors=16)),
}


def train_config(p, arch: str = "llama", method: str = "eagle3", **kw):
    """train.* for the preset: its TTT steps, and DFlash's layers, block and anchors."""
    from draftsmith.config import TrainConfig

    return TrainConfig(drafter_arch=arch, method=method, ttt_steps=p["steps"],
                       dflash=p.get("dflash", {}), **kw)


def make_drafter(p, device, arch: str = "llama", method: str = "eagle3"):
    """The drafter the train stage builds for a target of the preset's shape
    (train.loop.drafter_config), so the benchmark measures the layer training runs."""
    from types import SimpleNamespace

    from draftsmith.drafters.registry import build
    from draftsmith.train.loop import drafter_config

    torch.manual_seed(0)
    target = SimpleNamespace(
        model_type="a benchmark preset without MLA widths", hidden_size=p["H"],
        num_attention_heads=p["nh"], num_key_value_heads=p["nkv"], head_dim=p["hd"],
        intermediate_size=p["I"], vocab_size=p["V"], rms_norm_eps=1e-6,
        max_position_embeddings=max(p["lengths"]), **p.get("mla", {}))
    c = drafter_config(train_config(p, arch, method), target, p["Vd"], (2, 16, 29),
                       mask_token_id=0)
    m = build(c)
    for prm in m.parameters():
        torch.nn.init.normal_(prm, std=0.02)
    if hasattr(m, "d2t"):
        draft = torch.randperm(p["V"])[:p["Vd"]].sort().values
        m.d2t.copy_(draft - torch.arange(p["Vd"]))
        m.t2d[draft] = True
    return m.to(device)


def make_batch(p, T, rows, device, docs: int = 1):
    """rows rows of T tokens, each `docs` samples end to end (as the train stage packs them;
    the last takes the remainder), every token a response token (DFlash: every position a
    possible anchor)."""
    from draftsmith.drafters.batch import Batch

    g = torch.Generator().manual_seed(T)
    doc = (torch.arange(T) // (T // docs)).clamp(max=docs - 1)
    pos = torch.arange(T) - doc * (T // docs)
    return Batch(aux=torch.randn(rows, T, 3 * p["H"], generator=g).to(torch.bfloat16),
                 final=torch.randn(rows, T, p["H"], generator=g).to(torch.bfloat16),
                 ids=torch.randint(0, p["V"], (rows, T), generator=g),
                 loss_mask=torch.ones(rows, T, dtype=torch.bool),
                 doc=doc.expand(rows, T).contiguous(),
                 pos=pos.expand(rows, T).contiguous()).to(device)


HIDDEN_PRESETS = {
    "8b": dict(config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                           max_position_embeddings=16384),
               samples=64, median=1700, cap=8192, floor=64, layers=[2, 16, 29], repeats=1,
               row_tokens=8192, batch_rows=2),
    # Qwen3-8B's shape (q/k norms, head size 128, MLP 12,288, vocab 151,936); aux ids as
    # vLLM's default (2, L//2, L-3) for its 36 layers.
    "qwen3-8b": dict(config=dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                                 num_hidden_layers=36, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 max_position_embeddings=40960),
                     samples=64, median=1700, cap=8192, floor=64, layers=[2, 18, 33], repeats=1,
                     row_tokens=8192, batch_rows=2),
    "toy": dict(config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                            max_position_embeddings=512),
                samples=12, median=60, cap=200, floor=8, layers=[1, 2, 3], repeats=1,
                row_tokens=256, batch_rows=2),
}


def length_mix(p) -> list[int]:
    """Sample lengths: lognormal around `median` (sigma: its spread, 0.7 unless given), clipped
    to [floor, cap]; `seed` picks the draw."""
    rng = random.Random(p.get("seed", 0))
    sigma = p.get("sigma", 0.7)
    return [max(p["floor"], min(p["cap"], int(rng.lognormvariate(math.log(p["median"]), sigma))))
            for _ in range(p["samples"])]


def make_target(p, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(p["config"])
    config = AutoConfig.for_model(kw.pop("model_type", "llama"), **kw,
                                  attn_implementation="sdpa")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def write_tokenized(folder: Path, seqs: list[torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    from draftsmith.atomic import write_json

    folder.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": torch.cat(seqs).to(torch.int32),
               "loss_mask": torch.ones(sum(len(s) for s in seqs), dtype=torch.uint8),
               "cu_seqlens": torch.cumsum(torch.tensor([0] + [len(s) for s in seqs]), 0)},
              folder / "shard-00000.safetensors")
    write_json(folder / "manifest.json", {"vocab_size": 0, "shards": [
        {"file": "shard-00000.safetensors", "ids": [f"s{i:04d}" for i in range(len(seqs))]}]})
    return folder
