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


def _detect_format(columns: list[str], source: str) -> str:
    for fmt in ("messages", "sharegpt", "prompt"):
        if _DEFAULT_COLUMN[fmt] in columns:
            return fmt
    raise DraftsmithError(
        f"{source}: cannot tell the prompt format from the columns {columns}",
        "set generate.format (messages | sharegpt | prompt) and generate.column",
    )


class BadRow(DraftsmithError):
    """One row of a prompt source that cannot be read as a prompt (on_bad_row: drop skips it)."""


def source_rows(source: str, split: str) -> tuple[list[str], list[tuple[str, object]]]:
    """-> (the source's columns, [(where, row)]): `where` names the row for messages ("line 7",
    "row 12"); a row is a dict, or a BadRow when that row alone cannot be parsed. A source
    that cannot be read at all raises a DraftsmithError naming the file and the fix."""
    if source.startswith("hf:"):
        rows = _hub_rows(source, split)
        return rows.column_names, [(f"row {i}", r) for i, r in enumerate(rows)]
    path = Path(source)
    if not path.is_file():
        raise DraftsmithError(f"prompt source {source} does not exist or is not a file",
                              "point generate.source at a .jsonl, .json or .parquet file")
    head = path.read_bytes()[:4]
    if path.suffix == ".parquet" or head == b"PAR1":
        if path.suffix != ".parquet":
            raise DraftsmithError(f"{source} is a Parquet file (it starts with PAR1), not the "
                                  f"{path.suffix} its name says", f"rename it to {path.stem}.parquet")
        rows = _parquet_rows(path)
    else:
        rows = _json_rows(path)
    columns = list(dict.fromkeys(k for _, r in rows if isinstance(r, dict) for k in r))
    if not rows:
        raise DraftsmithError(f"{source} holds no rows", "point generate.source at a file "
                              "with one prompt or conversation per row")
    return columns, rows


def _hub_rows(source: str, split: str):
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(source[3:], split=split)
    except Exception as exc:  # the hub, the dataset or its split: the library's many errors
        raise DraftsmithError(f"cannot load {source} split '{split}': {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}",
                              "check the dataset id and generate.split, that the hub is "
                              "reachable (or the dataset is in the local HF cache), or use a "
                              "local file") from None


def _parquet_rows(path: Path) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DraftsmithError(f"{path} is not a readable Parquet file ({exc})",
                              "write it again (e.g. pandas.DataFrame.to_parquet), or export "
                              "the prompts as JSON Lines") from None
    return [(f"row {i}", r) for i, r in enumerate(table.to_pylist())]


def _json_rows(path: Path) -> list:
    """A .jsonl file (one JSON object a line), or a .json file holding a list of objects (or,
    as `datasets` reads them, JSON Lines)."""
    _check_utf8(path)
    text = path.read_bytes().decode("utf-8-sig")  # a byte-order mark is not content
    if "\x00" in text:
        raise DraftsmithError(f"{path} holds NUL bytes: it is binary, not JSON",
                              "export the prompts as JSON Lines (one object a line) or Parquet")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise DraftsmithError(f"{path} is not valid JSON ({_why(exc)})",
                                  "fix the file, or write it as JSON Lines") from None
        return [(f"item {i}", r if isinstance(r, dict) else _not_object(path, f"item {i}", r))
                for i, r in enumerate(items)]
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            r = BadRow(f"{path} line {n} is not JSON ({_why(exc)})",
                       "fix or remove that line (generate.on_bad_row: drop skips such lines)")
        rows.append((f"line {n}", r if isinstance(r, (dict, BadRow))
                     else _not_object(path, f"line {n}", r)))
    return rows


def _check_utf8(path: Path) -> None:
    """Name the line of a JSON file that is not UTF-8, before any work."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DraftsmithError(
                    f"{path} line {n} is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or remove "
                    "that line") from None


def _why(exc) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deep to read"
    return f"{exc.msg}; column {exc.colno}" if exc.lineno == 1 else \
        f"{exc.msg}; line {exc.lineno} column {exc.colno}"


def _not_object(path: Path, where: str, value) -> BadRow:
    return BadRow(f"{path} {where} is a JSON {type(value).__name__}, not an object",
                  "write one object per row, e.g. {\"prompt\": \"...\"} or "
                  "{\"messages\": [...]}")


def dataset_prompts(source: str, split: str, fmt: str, column: str | None, limit: int,
                    on_bad_row: str = "fail", dropped: list | None = None) -> list[Prompt]:
    """The first `limit` distinct prompts. on_bad_row: fail (the first bad row raises, naming
    it) | drop (bad rows are skipped and their messages appended to `dropped`; a source with
    no good row still fails). Every row of a local file is checked, not only those used."""
    columns, rows = source_rows(source, split)
    if not columns:  # not one row could be read: say why the first one could not
        raise next((r for _, r in rows if isinstance(r, BadRow)), DraftsmithError(
            f"{source}: its rows have no fields", "write one object per row, e.g. "
            "{\"prompt\": \"...\"} or {\"messages\": [...]}"))
    fmt = _detect_format(columns, source) if fmt == "auto" else fmt
    column = column or _DEFAULT_COLUMN[fmt]
    if column not in columns:
        raise DraftsmithError(
            f"{source} has no column '{column}' (columns: {columns})",
            "set generate.column to the column holding the conversation or prompt",
        )
    prompts, seen, bad = [], set(), []
    for i, (where, row) in enumerate(rows):
        try:
            p = _row_prompt(source, where, row, column, fmt, i)
        except BadRow as exc:
            if on_bad_row == "fail":
                raise
            bad.append(exc.problem)
            continue
        if p.id not in seen and len(prompts) < limit:  # a duplicate would share an id
            seen.add(p.id)
            prompts.append(p)
        # A local file is read whole, so a broken row is found wherever it is; a hub dataset
        # only as far as the prompts asked for.
        if len(prompts) == limit and source.startswith("hf:"):
            break
    if bad and not prompts:
        raise DraftsmithError(f"{source}: none of its rows is a usable prompt ({len(bad)} "
                              f"bad; the first: {bad[0]})",
                              "set generate.format/generate.column to match the data")
    if dropped is not None:
        dropped.extend(bad)
    return prompts


def _row_prompt(source: str, where: str, row, column: str, fmt: str, index: int) -> Prompt:
    if isinstance(row, BadRow):
        raise row
    if column not in row:
        raise BadRow(f"{source} {where} has no '{column}' (it has {sorted(row)})",
                     "give every row that column, or set generate.on_bad_row: drop")
    try:
        return make_prompt(_to_messages(row[column], fmt), source_index=index)
    except EmptyPrompt as exc:
        raise BadRow(f"{source} {where}: {exc}",
                     "remove empty prompts from the source, or set generate.on_bad_row: "
                     "drop") from None
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise BadRow(
            f"{source} {where}: column '{column}' is not in {fmt} format "
            f"({type(exc).__name__}: {exc})",
            "set generate.format/generate.column to match the data, or generate.on_bad_row: "
            "drop to skip such rows",
        ) from None


def load_prompts(source: str, *, split: str, fmt: str, column: str | None, limit: int,
                 seed: int, on_bad_row: str = "fail", dropped: list | None = None
                 ) -> list[Prompt]:
    if source == "builtin":
        # Over-draw, then de-duplicate, so `limit` distinct prompts come back.
        out, seen = [], set()
        for p in builtin_prompts(limit * 2, seed, "generate"):
            if p.id not in seen:
                seen.add(p.id)
                out.append(p)
        return out[:limit]
    return dataset_prompts(source, split, fmt, column, limit, on_bad_row, dropped)
