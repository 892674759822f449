"""The hidden stage's two engines side by side on the same samples, in one run: `hidden.engine:
hf` (the target in transformers, in this process) and `hidden.engine: vllm` (a vLLM server with
its hidden-state capture, launched by the stage), each through `hidden.run` as the stage calls
it, one after the other (never at once: they would share the cores).

    python benchmarks/hidden_engines.py --repo . \
        --server-command "$VLLM_PYTHON src/draftsmith/serving/vllm_cpu.py serve {model}" \
        --json benchmarks/results/hidden_engines_cpu.json

--repo: a pipeline that has run through `tokenize` (its models/target and data/tokenized; the
params are its params.yaml's hidden section). Per engine: wall_s (the stage's whole run: model
load or server start, extraction, shards written), startup_s (the vLLM server's start to
healthy; the hf engine's model load), stop_s (the server's stop), tokens_per_s over the wall
less both, and over the whole wall. Then the two artifacts compared: manifest equal (same shards, samples, tokens), the
fraction of stored values that differ and the largest difference relative to each state's
scale. A GPU vLLM is not installable on the lent GPU machines: this runs on the CPU (vllm-cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from _common import run_info, save_results
from draftsmith import hidden
from draftsmith.config import ServerConfig, load_config
from draftsmith.hidden_format import HIDDEN_MANIFEST, iter_hidden
from draftsmith.serving.server import ManagedServer


def run_engine(engine: str, repo: Path, out: Path, server: ServerConfig) -> dict:
    cfg = load_config(repo / "params.yaml")
    hcfg = cfg.hidden.model_copy(update={"engine": engine, "mode": "offline"})
    target, tokenized = repo / "models/target", repo / "data/tokenized"
    t0 = time.perf_counter()
    if engine == "hf":  # hidden.run's hf path, its model load timed apart
        from draftsmith.capture import set_attention
        from draftsmith.config import check_aux_layers
        from draftsmith.target_info import load_model, load_tokenizer, read_info

        info = read_info(target)
        model = load_model(target, device="cpu")
        set_attention(model, hcfg.attention)
        startup = time.perf_counter() - t0
        metrics = hidden.write_hidden(hcfg, model, check_aux_layers(hcfg, info.num_layers),
                                      tokenized, out / engine, info.revision or "",
                                      load_tokenizer(target).pad_token_id or 0)
        stop = 0.0
    else:
        before, stops = len(ManagedServer.startups), []
        with _timed_stops(stops):
            metrics = hidden.run(hcfg, target, tokenized, out / engine, server=server,
                                 work_dir=out / f"{engine}.work")
        startup, stop = ManagedServer.startups[before], sum(stops)
    wall = time.perf_counter() - t0
    tokens = metrics["tokens"]
    return {"engine": engine, "samples": metrics["samples"], "tokens": tokens,
            "shards": metrics["shards"], "wall_s": round(wall, 2), "startup_s": round(startup, 2),
            "stop_s": round(stop, 2), "tokens_per_s": round(tokens / (wall - startup - stop)),
            "tokens_per_s_with_startup": round(tokens / wall)}


@contextmanager
def _timed_stops(stops: list):
    """The server's stop timed apart from the extraction (it waits for vLLM to exit)."""
    stop = ManagedServer.stop

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return stop(self, *args, **kwargs)
        finally:
            stops.append(time.perf_counter() - t0)

    ManagedServer.stop = timed
    try:
        yield
    finally:
        ManagedServer.stop = stop


def compare(a: Path, b: Path) -> dict:
    """Stored values of two artifacts: manifests (shards, samples) equal, and how many values
    differ, the largest by the state's scale (its max |value|, per token)."""
    ma, mb = (json.loads((d / HIDDEN_MANIFEST).read_text()) for d in (a, b))
    same_layout = [(s["ids"], s["lengths"]) for s in ma["shards"]] == \
                  [(s["ids"], s["lengths"]) for s in mb["shards"]]
    other = {sid: (aux, final) for sid, aux, final, _, _ in iter_hidden(b)}
    values = differ = 0
    worst = 0.0
    for sid, aux, final, _, _ in iter_hidden(a):
        for x, y in zip((aux, final), other[sid]):
            x, y = x.float(), y.float()
            values += x.numel()
            differ += int((x != y).sum())
            scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
            worst = max(worst, float(((x - y).abs() / scale).max()))
    return {"same_shards_and_samples": same_layout,
            "shards_byte_equal": [x["sha256"] for x in ma["shards"]] ==
                                 [x["sha256"] for x in mb["shards"]], "values": values,
            "values_differing": differ, "fraction_differing": differ / max(values, 1),
            "max_diff_of_scale": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, default=Path("."))
    ap.add_argument("--server-command", required=True,
                    help="the vLLM launcher, {model} for the target's directory")
    ap.add_argument("--extra-args", default="--enforce-eager")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    server = ServerConfig(command=args.server_command, extra_args=args.extra_args,
                          concurrency=args.concurrency)
    out = {**run_info(torch.device("cpu"), None), "torch_threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count(), "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for engine in ("hf", "vllm"):
            r = run_engine(engine, args.repo.resolve(), tmp, server)
            out["results"].append(r)
            print(json.dumps(r))
        out["artifacts"] = compare(tmp / "hf", tmp / "vllm")
    hf, vllm = out["results"]
    out["vllm_over_hf"] = round(vllm["tokens_per_s"] / hf["tokens_per_s"], 3)
    print(json.dumps(out["artifacts"]))
    print(f"vllm / hf tokens/s (startup excluded): {out['vllm_over_hf']}")
    save_results(args.json, out)


if __name__ == "__main__":
    main()
