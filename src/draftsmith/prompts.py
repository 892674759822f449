"""Prompt sources for the generate stage: built-in toy prompts, local files, HF datasets.

Every prompt gets a stable id from its content, so resumed or re-ordered runs, and the
benchmark's held-out check, match samples by id rather than by line number.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import DraftsmithError

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant", "bing": "assistant"}
_DEFAULT_COLUMN = {"messages": "messages", "sharegpt": "conversations", "prompt": "prompt"}


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict]
    meta: dict = field(default_factory=dict)


def prompt_id(messages: list[dict]) -> str:
    canonical = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def make_prompt(messages: list[dict], **meta) -> Prompt:
    return Prompt(prompt_id(messages), messages, meta)


def builtin_prompts(n: int, seed: int, split: str) -> list[Prompt]:
    from draftsmith.toy import tasks

    return [make_prompt([{"role": "user", "content": ex.prompt}], task=ex.task, answer=ex.answer)
            for ex in tasks.examples(n, seed, split)]


def _to_messages(value, fmt: str) -> list[dict]:
    """One dataset cell -> the conversation up to and including its last user turn."""
    if fmt == "prompt":
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        value = [{"role": "user", "content": value}]
    if isinstance(value, str):
        value = json.loads(value)
    if fmt == "sharegpt":
        msgs = [{"role": _SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in value]
    else:
        msgs = [{"role": t["role"], "content": t["content"]} for t in value]
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    if last_user < 0:
        raise ValueError("conversation has no user turn")
    if not str(msgs[last_user]["content"]).strip():
        raise EmptyPrompt("its last user turn is empty")
    return msgs[: last_user + 1]


class EmptyPrompt(ValueError):
    pass


def _detect_format(columns: list[str]) -> str:
    for fmt in ("messages", "sharegpt", "prompt"):
        if _DEFAULT_COLUMN[fmt] in columns:
            return fmt
    raise DraftsmithError(
        f"cannot tell the prompt format from the columns {columns}",
        "set generate.format (messages | sharegpt | prompt) and generate.column",
    )


def load_dataset_rows(source: str, split: str):
    import datasets

    datasets.disable_progress_bars()
    if source.startswith("hf:"):
        return datasets.load_dataset(source[3:], split=split)
    kind = "parquet" if source.endswith(".parquet") else "json"
    if kind == "json":
        _check_utf8(Path(source))
    return datasets.load_dataset(kind, data_files=source, split="train")


def _check_utf8(path: Path) -> None:
    """Name the line of a JSONL file that is not UTF-8, before any work."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DraftsmithError(
                    f"{path} line {n} is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or remove "
                    "that line") from None


def dataset_prompts(source: str, split: str, fmt: str, column: str | None, limit: int
                    ) -> list[Prompt]:
    rows = load_dataset_rows(source, split)
    fmt = _detect_format(rows.column_names) if fmt == "auto" else fmt
    column = column or _DEFAULT_COLUMN[fmt]
    if column not in rows.column_names:
        raise DraftsmithError(
            f"{source} has no column '{column}' (columns: {rows.column_names})",
            "set generate.column to the column holding the conversation or prompt",
        )
    prompts, seen = [], set()
    for i, value in enumerate(rows[column]):
        try:
            p = make_prompt(_to_messages(value, fmt), source_index=i)
        except EmptyPrompt as exc:
            raise DraftsmithError(f"{source} row {i}: {exc}",
                                  "remove empty prompts from the source") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise DraftsmithError(
                f"{source} row {i}: column '{column}' is not in {fmt} format ({exc})",
                "set generate.format/generate.column to match the data",
            ) from None
        if p.id not in seen:  # duplicate prompts would share an id; keep the first
            seen.add(p.id)
            prompts.append(p)
            if len(prompts) == limit:
                break
    return prompts


def load_prompts(source: str, *, split: str, fmt: str, column: str | None, limit: int,
                 seed: int) -> list[Prompt]:
    if source == "builtin":
        # Over-draw, then de-duplicate, so `limit` distinct prompts come back.
        out, seen = [], set()
        for p in builtin_prompts(limit * 2, seed, "generate"):
            if p.id not in seen:
                seen.add(p.id)
                out.append(p)
        return out[:limit]
    return dataset_prompts(source, split, fmt, column, limit)
