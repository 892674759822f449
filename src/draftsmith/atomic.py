"""Write-then-rename helpers: an interrupted stage never leaves a half-written artifact."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling path; on success it replaces `path` (file or directory).
    One writer per path (a stage's own outputs): a temp sibling left by a killed earlier run
    is removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a SIGKILLed writer
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    target = tmp / path.name
    try:
        yield target
        if os.environ.get("DRAFTSMITH_FAULT_PAUSE_BEFORE_RENAME"):  # the fault suite's kill point
            import time

            time.sleep(3600)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(target, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_jsonl(path: Path, rows: Iterable[dict]) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    """A file's sha256, read in 16 MB chunks (hashlib releases the GIL on large buffers)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_digest(path: Path, expected: dict, fix: str) -> None:
    """Raise DraftsmithError naming `path` unless its size and sha256 are `expected`
    ({"bytes": n, "sha256": hex}): a truncated or corrupted file is caught before it is read."""
    from draftsmith.errors import DraftsmithError

    path = Path(path)
    if not path.exists():
        raise DraftsmithError(f"{path} is missing", fix)
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise DraftsmithError(f"{path} is truncated or altered: {size} bytes, the manifest "
                              f"says {expected['bytes']}", fix)
    if file_sha256(path) != expected["sha256"]:
        raise DraftsmithError(f"{path} is corrupted: its sha256 differs from the manifest's", fix)
