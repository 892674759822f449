"""Where a vLLM server's start-up goes, read from its log: the seconds of each phase vLLM
reports (weights, torch.compile and whether its cache served the graphs, CUDA graph capture,
the whole engine init) and the span from its first log line to "startup complete".

    python benchmarks/vllm_startup.py LOG [LOG ...]      # one JSON line per log

decode_speed.py adds these to its results for every server it starts (--logs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _common.serving import phases


def main(argv=None) -> int:
    for log in argv if argv is not None else sys.argv[1:]:
        print(json.dumps({"log": log, **phases(Path(log).read_text(errors="replace"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
