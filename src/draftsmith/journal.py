"""An append-only journal of finished samples: the resume point of an interrupted stage.

Workers finish out of order, so resuming by counting lines would skip or repeat samples (the
failure in deepseek-ai/DeepSpec#35). Each line is one whole record keyed by its stable sample
id, written by one thread and flushed; on reload a torn last line (the process was killed
mid-write) is dropped and duplicates collapse to one. The first line pins what the records
were made from (`key`): a journal of another config or target is discarded, not mixed in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class Journal:
    def __init__(self, path: Path, key: str):
        self.path, self.key = Path(path), key
        self._file = None

    def load(self) -> dict[str, dict]:
        """Records already finished by an earlier run of the same work, by id."""
        if not self.path.exists():
            return {}
        done: dict[str, dict] = {}
        with open(self.path) as f:
            lines = f.read().split("\n")
        try:
            header = json.loads(lines[0])
        except ValueError:
            header = {}
        if header.get("journal") != self.key:
            return {}
        for line in lines[1:]:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the torn tail of a killed write
            if isinstance(rec, dict) and "id" in rec:
                done[rec["id"]] = rec
        return done

    def open(self, done: dict[str, dict]) -> None:
        """Start appending: rewrite the file as header + the kept records (drops a torn tail)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".rewrite")
        with open(tmp, "w") as f:
            f.write(json.dumps({"journal": self.key}) + "\n")
            for rec in done.values():
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
