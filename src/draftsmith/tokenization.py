"""Tokenize stage: raw samples -> chat-templated token ids with assistant-only loss masks.

Output: `shard-XXXXX.safetensors` files, each holding the samples' tokens packed end to end
(`input_ids` int32, `loss_mask` uint8, `cu_seqlens` int64 sample boundaries; no padding), and
`manifest.json` with the sample ids of each shard. The format check (see draftsmith.render)
runs on every sample before anything is written.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftsmith.artifacts import SAMPLES_FILE, TOKENIZED_MANIFEST as MANIFEST
from draftsmith.atomic import atomic_path, read_jsonl, write_json
from draftsmith.config import TokenizeConfig
from draftsmith.errors import DraftsmithError
from draftsmith.render import render_sample
from draftsmith.target_info import load_tokenizer, read_info

_PROBLEM_HELP = {
    "emission_mismatch": "the parsed reasoning/content do not rebuild the raw completion: the "
                         "reasoning wrapper or its separators were lost (check the chat format)",
    "template_prompt_mismatch": "the chat template renders the conversation's prompt part "
                                "differently once an assistant turn follows",
    "template_turn_mismatch": "the chat template renders the assistant turn differently from what "
                              "the model emits (dropped reasoning, an inserted empty think block, "
                              "or reasoning joined to the answer without the wrapper)",
}


def encode(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response and the loss mask (1 on response tokens).

    Encoded separately so the prompt ids are exactly those the target was served, and the
    boundary never falls inside a merged token."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"]
    return p + r, [0] * len(p) + [1] * len(r)


def run(cfg: TokenizeConfig, target_dir: Path, raw_dir: Path, out_dir: Path) -> dict:
    info = read_info(target_dir)
    fmt = info.format
    tokenizer = load_tokenizer(target_dir)
    records = read_jsonl(Path(raw_dir) / SAMPLES_FILE)
    dropped: Counter = Counter()
    problems: Counter = Counter()
    examples: dict[str, str] = {}
    kept: list[tuple[str, list[int], list[int]]] = []
    checked = passed = 0
    for rec in tqdm(records, desc="tokenize", unit="sample"):
        if rec["finish_reason"] != "stop" and cfg.truncated == "drop":
            dropped["truncated"] += 1
            continue
        if rec.get("well_formed") is False:
            dropped["malformed"] += 1  # the model's own output broke its format: not trainable
            continue
        r = render_sample(tokenizer, fmt, rec, check_template=cfg.check_template)
        checked += 1
        if r.problems:
            problems.update(r.problems)
            for p in r.problems:
                examples.setdefault(p, rec["id"])
            dropped["format_error"] += 1
            continue
        passed += 1
        ids, mask = encode(tokenizer, r.prompt, r.response)
        if len(ids) > cfg.max_length:
            dropped["too_long"] += 1
            continue
        kept.append((rec["id"], ids, mask))

    finished = sum(1 for rec in records if rec["finish_reason"] == "stop")
    if finished and dropped["malformed"] / finished > cfg.max_malformed_share:
        raise DraftsmithError(
            f"{dropped['malformed']} of {finished} finished samples are not in the target's own "
            f"chat format '{fmt.name}' (e.g. the reasoning wrapper is missing): more than "
            f"tokenize.max_malformed_share={cfg.max_malformed_share}",
            "check how the samples were generated (a server without the right reasoning parser "
            "returns no reasoning field; generate.thinking must match the model), then rerun "
            "generate; raise tokenize.max_malformed_share only if such samples are expected")
    if problems and cfg.on_format_error == "fail":
        detail = "\n  ".join(f"{p}: {n} sample(s), e.g. id {examples[p]} - {_PROBLEM_HELP[p]}"
                             for p, n in problems.items())
        raise DraftsmithError(
            f"format check failed for {checked - passed} of {checked} samples:\n  {detail}",
            "fix the generation/template (see above); tokenize.check_template: false skips the "
            "template comparison for templates that rewrite history on purpose; tokenize.on_format_error: drop drops failing samples",
        )
    if not kept:
        raise DraftsmithError(f"no samples left after tokenize (dropped: {dict(dropped)})",
                              "check tokenize.max_length and tokenize.truncated")
    _write_shards(kept, cfg.shard_size, Path(out_dir), tokenizer_vocab=len(tokenizer))
    tokens = sum(len(ids) for _, ids, _ in kept)
    return {
        "samples_in": len(records),
        "samples_kept": len(kept),
        "dropped": {k: dropped.get(k, 0)
                    for k in ("truncated", "malformed", "format_error", "too_long")},
        "chat_format": fmt.to_dict(),  # as the target stage resolved it (probed, named, declared)
        "format_check_pass_rate": round(passed / checked, 4) if checked else None,
        "format_problems": dict(problems),
        "tokens": tokens,
        "loss_tokens": sum(sum(m) for _, _, m in kept),
        "mean_tokens_per_sample": round(tokens / len(kept), 2),
    }


def _write_shards(kept, shard_size: int, out_dir: Path, tokenizer_vocab: int) -> None:
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        shards = []
        for s, i in enumerate(range(0, len(kept), shard_size)):
            part = kept[i:i + shard_size]
            lengths = torch.tensor([0] + [len(ids) for _, ids, _ in part])
            name = f"shard-{s:05d}.safetensors"
            save_file({
                "input_ids": torch.tensor([t for _, ids, _ in part for t in ids], dtype=torch.int32),
                "loss_mask": torch.tensor([m for _, _, mask in part for m in mask], dtype=torch.uint8),
                "cu_seqlens": torch.cumsum(lengths, 0),
            }, tmp / name)
            shards.append({"file": name, "ids": [sid for sid, _, _ in part]})
        write_json(tmp / MANIFEST, {"vocab_size": tokenizer_vocab, "shards": shards})
