"""Generate stage: answer prompts with the target and keep its reasoning.

Each record in `samples.jsonl` is keyed by the prompt's stable id and carries the messages,
the parsed reasoning and content, the raw completion (special tokens kept, when the backend
has it), the finish reason and token counts. The backend sits behind `complete_prompts` so a
server backend can replace the in-process one without changing the records.
"""

from __future__ import annotations

import time
from pathlib import Path

from draftsmith.atomic import write_jsonl
from draftsmith.config import GenerateConfig
from draftsmith.errors import DraftsmithError
from draftsmith.inprocess import complete
from draftsmith.prompts import Prompt, load_prompts
from draftsmith.render import prompt_text
from draftsmith.target import load_model, load_tokenizer, read_info

SAMPLES_FILE = "samples.jsonl"


def _record(p: Prompt, fmt, out, thinking: bool, prompt_tokens: int) -> dict:
    reasoning, content, think_closed, _ = fmt.parse(out.text, thinking=thinking)
    return {
        "id": p.id, "messages": p.messages, "thinking": thinking, "reasoning": reasoning,
        "content": content, "completion": out.text, "finish_reason": out.finish_reason,
        "think_closed": think_closed,
        "well_formed": fmt.well_formed(out.text, thinking=thinking),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": out.num_tokens, "meta": p.meta,
    }


def run(cfg: GenerateConfig, target_dir: Path, out_dir: Path) -> dict:
    """Write out_dir/samples.jsonl and return the stage's metrics."""
    info = read_info(target_dir)
    fmt = info.format
    if cfg.thinking and not fmt.supports_reasoning:
        raise DraftsmithError(
            f"generate.thinking is on but the target's chat format '{fmt.name}' has no reasoning",
            "set generate.thinking: false for this target",
        )
    prompts = load_prompts(cfg.source, split=cfg.split, fmt=cfg.format, column=cfg.column,
                           limit=cfg.num_samples, seed=cfg.seed)
    if len(prompts) < cfg.num_samples:
        raise DraftsmithError(
            f"generate.num_samples={cfg.num_samples} but {cfg.source} holds only {len(prompts)} "
            "distinct prompts", f"set generate.num_samples <= {len(prompts)}")

    tokenizer = load_tokenizer(target_dir)
    model = load_model(target_dir)
    texts = [prompt_text(tokenizer, p.messages, cfg.thinking) for p in prompts]
    eos = tokenizer.convert_tokens_to_ids(fmt.end_of_turn)
    t0 = time.time()
    outs = complete(model, tokenizer, texts, eos_token_id=eos, max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                    batch_size=cfg.batch_size, progress="generate")
    seconds = time.time() - t0
    prompt_lens = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    records = [_record(p, fmt, o, cfg.thinking, n) for p, o, n in zip(prompts, outs, prompt_lens)]
    write_jsonl(Path(out_dir) / SAMPLES_FILE, records)
    return summarize(records, seconds)


def summarize(records: list[dict], seconds: float, errors: int = 0) -> dict:
    finished = [r for r in records if r["finish_reason"] == "stop"]
    malformed = [r for r in finished if r.get("well_formed") is False]
    thinking = [r for r in finished if r["thinking"] and r.get("well_formed") is not False]
    captured = [r for r in thinking if r["reasoning"] and r["think_closed"]]
    tokens = sum(r["completion_tokens"] for r in records)
    return {
        "samples": len(records),
        "errors": errors,
        # Of finished, well-formed samples asked to think: reasoning found inside the wrapper.
        "reasoning_capture_rate": round(len(captured) / len(thinking), 4) if thinking else None,
        "truncated_share": round(1 - len(finished) / len(records), 4) if records else 0.0,
        # Finished samples whose raw output is not in the model's own chat format.
        "malformed_share": round(len(malformed) / len(finished), 4) if finished else 0.0,
        "total_response_tokens": tokens,
        "mean_response_tokens": round(tokens / len(records), 2) if records else 0.0,
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
    }
