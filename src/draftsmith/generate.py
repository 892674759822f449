"""Generate stage: answer prompts with the target and keep its reasoning.

Each record in `samples.jsonl` is keyed by the prompt's stable id and carries the messages,
the parsed reasoning and content, the raw completion (special tokens kept, when the backend
has it), the finish reason and token counts. Two backends produce the same records: the
target run in this process (`inprocess`) and OpenAI-compatible servers (`openai`: vLLM,
SGLang), given by URL or launched on the target for the stage's duration.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.artifacts import SAMPLES_FILE
from draftsmith.atomic import write_jsonl
from draftsmith.config import GenerateConfig, ServerConfig
from draftsmith.errors import DraftsmithError
from draftsmith.inprocess import Completion, complete_iter
from draftsmith.journal import Journal
from draftsmith.prompts import Prompt, load_prompts
from draftsmith.render import prompt_text
from draftsmith.serving.client import ChatClient, ChatRequest
from draftsmith.serving.memory import EngineNeed
from draftsmith.serving.server import serve_target
from draftsmith.target_info import context_length, load_model, load_tokenizer, read_info

JOURNAL_FILE = "journal.jsonl"  # finished samples of an unfinished run, in the work dir


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


def run(cfg: GenerateConfig, target_dir: Path, out_dir: Path, server: ServerConfig | None = None,
        work_dir: Path | None = None) -> dict:
    """Write out_dir/samples.jsonl and return the stage's metrics.

    Finished samples go to a journal in `work_dir` as they complete; a rerun after an
    interruption (a killed stage, a crashed server) only asks for the missing ones."""
    info = read_info(target_dir)
    fmt = info.format
    if cfg.thinking and not fmt.supports_reasoning:
        raise DraftsmithError(
            f"generate.thinking is on but the target's chat format '{fmt.name}' has no reasoning "
            f"(its chat template renders no reasoning for an assistant turn)",
            "set generate.thinking: false for this target, or declare where it writes its "
            "reasoning in target.chat_format (reasoning_open, reasoning_close, end_of_turn)",
        )
    dropped: list[str] = []
    prompts = load_prompts(cfg.source, split=cfg.split, fmt=cfg.format, column=cfg.column,
                           limit=cfg.num_samples, seed=cfg.seed, on_bad_row=cfg.on_bad_row,
                           dropped=dropped)
    if dropped:
        print(f"generate: dropped {len(dropped)} bad row(s) of {cfg.source} "
              f"(generate.on_bad_row: drop); the first: {dropped[0]}")
    if len(prompts) < cfg.num_samples:
        raise DraftsmithError(
            f"generate.num_samples={cfg.num_samples} but {cfg.source} holds only {len(prompts)} "
            "distinct prompts", f"set generate.num_samples <= {len(prompts)}")

    tokenizer = load_tokenizer(target_dir)
    texts = {p.id: prompt_text(tokenizer, p.messages, cfg.thinking) for p in prompts}
    lengths = {p.id: len(tokenizer(texts[p.id], add_special_tokens=False)["input_ids"])
               for p in prompts}
    _check_context(cfg, prompts, lengths, context_length(target_dir))
    work_dir = Path(work_dir or Path(out_dir).parent / f"{Path(out_dir).name}.work")
    journal = Journal(work_dir / JOURNAL_FILE, _journal_key(cfg, info, prompts))
    done = journal.load()
    todo = [p for p in prompts if p.id not in done]
    if done:
        print(f"generate: resuming, {len(done)} of {len(prompts)} samples already done")
    journal.open(done)
    clock, new_tokens = {"start": time.time()}, 0
    try:
        for p, out in _backend(cfg, server, info, target_dir, tokenizer, todo, texts, work_dir,
                               clock, max(lengths.values(), default=0) + cfg.max_new_tokens):
            done[p.id] = _record(p, fmt, out, cfg.thinking, lengths[p.id])
            journal.append(done[p.id])
            new_tokens += out.num_tokens
    finally:
        journal.close()
    seconds = time.time() - clock["start"]  # generation only: no model load, no server start
    records = [done[p.id] for p in prompts]  # prompt order, each id exactly once
    write_jsonl(Path(out_dir) / SAMPLES_FILE, records)
    journal.remove()
    metrics = summarize(records, seconds)
    metrics.update(backend=cfg.backend, resumed_samples=len(prompts) - len(todo),
                   bad_rows_dropped=len(dropped),
                   tokens_per_s=round(new_tokens / seconds, 1) if todo and seconds > 0 else None)
    return metrics


def _check_context(cfg: GenerateConfig, prompts: list[Prompt], lengths: dict,
                   context: int | None) -> None:
    """Before any request: every prompt (lengths: its tokens) plus max_new_tokens fits the
    target's context (a server would refuse the request, an in-process model run past its
    positions)."""
    if not context:
        return
    long = []
    for row, p in enumerate(prompts):
        n = lengths[p.id]
        if n + cfg.max_new_tokens > context:
            long.append((row, p, n))
    if long:
        row, p, n = long[0]
        room = context - max(m for _, _, m in long)
        raise DraftsmithError(
            f"{len(long)} of {len(prompts)} prompts do not fit the target's context of {context} "
            f"tokens with generate.max_new_tokens={cfg.max_new_tokens}; the first, "
            f"{cfg.source} row {p.meta.get('source_index', row)} (counting from 0; id {p.id}), has "
            f"{n} prompt tokens",
            "remove or shorten the long prompts in the source"
            + (f", or lower generate.max_new_tokens to at most {room}" if room > 0 else ""))


def _journal_key(cfg: GenerateConfig, info, prompts: list[Prompt]) -> str:
    """What the records depend on: the target, the sampling settings and the prompts (not
    the backend, its batch size or its servers)."""
    what = cfg.model_dump(exclude={"backend", "batch_size"})
    h = hashlib.sha256(json.dumps([what, info.revision, [p.id for p in prompts]],
                                  sort_keys=True).encode())
    return h.hexdigest()[:16]


def _backend(cfg: GenerateConfig, server: ServerConfig | None, info, target_dir: Path,
             tokenizer, todo: list[Prompt], texts: dict, work_dir: Path, clock: dict,
             longest: int) -> Iterator[tuple[Prompt, Completion]]:
    """Completions of `todo`, in any order, from the configured backend. Sets
    clock["start"] when generation itself begins. longest: the longest request's tokens
    (prompt and answer), which a launched engine's KV cache is sized for."""
    if not todo:
        return
    if cfg.backend == "inprocess":
        model = load_model(target_dir)
        eos = tokenizer.convert_tokens_to_ids(info.format.end_of_turn)
        clock["start"] = time.time()
        for i, out in complete_iter(model, tokenizer, [texts[p.id] for p in todo],
                                    eos_token_id=eos, max_new_tokens=cfg.max_new_tokens,
                                    temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                                    batch_size=cfg.batch_size, progress="generate"):
            yield todo[i], out
        return
    server = server or ServerConfig()
    by_id = {p.id: p for p in todo}
    need = EngineNeed("generate", longest, what="the stage only sends requests")
    with serve_target(server, target_dir, work_dir, seed=cfg.seed, need=need) as urls:
        client = ChatClient(server, urls, info.format)
        requests = [ChatRequest(p.id, p.messages, _sampling(cfg, p.id)) for p in todo]
        clock["start"] = time.time()
        try:
            for req, out in tqdm(client.stream(requests), total=len(requests), desc="generate",
                                 unit="sample"):
                yield by_id[req.id], out
        finally:
            client.close()


def _sampling(cfg: GenerateConfig, sample_id: str) -> dict:
    # A seed per sample (from its id, not its position) keeps sampled answers the same
    # whatever the order, concurrency or number of servers.
    return {"max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
            "top_p": cfg.top_p, "seed": (cfg.seed * 1_000_003 + int(sample_id[:8], 16)) % 2**31,
            "chat_template_kwargs": {"enable_thinking": cfg.thinking}}


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
