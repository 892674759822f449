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
scale, overall and per captured layer (each aux layer and the last: a capture that drops or
norms the last layer, vLLM issue 48124 and PR 46973, shows there as a difference near 1), with
a verdict against --tol.

On a GPU (the H200 run in benchmarks/results/README.md), with GPU vLLM:

    python benchmarks/hidden_engines.py --repo . --device cuda --extra-args "" \
        --server-command "vllm serve {model}" --json hidden_engines_gpu.json
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

from _common.results import run_info, save_results
from draftsmith import hidden
from draftsmith.config import ServerConfig, load_config
from draftsmith.hidden_format import HIDDEN_MANIFEST, iter_hidden
from draftsmith.serving.server import ManagedServer


def run_engine(engine: str, repo: Path, out: Path, server: ServerConfig,
               device: str = "cpu") -> dict:
    cfg = load_config(repo / "params.yaml")
    hcfg = cfg.hidden.model_copy(update={"engine": engine, "mode": "offline"})
    target, tokenized = repo / "models/target", repo / "data/tokenized"
    t0 = time.perf_counter()
    if engine == "hf":  # hidden.run's hf path, its model load timed apart
        from draftsmith.capture import set_attention
        from draftsmith.config import check_aux_layers
        from draftsmith.target_info import load_model, load_tokenizer, read_info

        info = read_info(target)
        model = load_model(target, device=device)
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


def token_diff(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per token (and layer): max |x - y| / max |x| over its state (the last dim)."""
    return (x - y).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-12)


def layer_summary(r: torch.Tensor, tol: float) -> dict:
    """One captured layer's token_diff over its tokens: largest, p99, how many over tol."""
    return {"max_diff_of_scale": float(r.max()),
            "p99_diff_of_scale": float(torch.quantile(r, 0.99)),
            "tokens_over_tol": int((r > tol).sum()), "tokens": len(r)}


def compare(a: Path, b: Path, tol: float) -> dict:
    """Stored values of two artifacts: manifests (shards, samples) equal, and how many values
    differ, the largest by the state's scale (its max |value|, per token and layer), overall
    and per captured layer ("layer N" for an aux layer, "last" for the final state)."""
    ma, mb = (json.loads((d / HIDDEN_MANIFEST).read_text()) for d in (a, b))
    same_layout = [(s["ids"], s["lengths"]) for s in ma["shards"]] == \
                  [(s["ids"], s["lengths"]) for s in mb["shards"]]
    names = [f"layer {n}" for n in ma["aux_layers"]] + ["last"]
    other = {sid: (aux, final) for sid, aux, final, _, _ in iter_hidden(b)}
    rel: dict[str, list] = {n: [] for n in names}  # per token: max |x - y| / max |x|
    values = differ = 0
    for sid, aux, final, _, _ in iter_hidden(a):
        oaux, ofinal = other[sid]
        x = torch.cat([aux.view(len(aux), -1, final.shape[-1]), final[:, None]], 1).float()
        y = torch.cat([oaux.view(len(oaux), -1, ofinal.shape[-1]), ofinal[:, None]], 1).float()
        values += x.numel()
        differ += int((x != y).sum())
        r = token_diff(x, y)  # (tokens, layers)
        for i, n in enumerate(names):
            rel[n].append(r[:, i])
    per_layer = {n: layer_summary(torch.cat(rel[n]), tol) for n in names}
    return {"same_shards_and_samples": same_layout,
            "shards_byte_equal": [x["sha256"] for x in ma["shards"]] ==
                                 [x["sha256"] for x in mb["shards"]], "values": values,
            "values_differing": differ, "fraction_differing": differ / max(values, 1),
            "max_diff_of_scale": max(v["max_diff_of_scale"] for v in per_layer.values()),
            "tol": tol, "per_layer": per_layer,
            "every_layer_within_tol": all(not v["tokens_over_tol"] for v in per_layer.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, default=Path("."))
    ap.add_argument("--server-command", required=True,
                    help="the vLLM launcher, {model} for the target's directory")
    ap.add_argument("--extra-args", default="--enforce-eager")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--device", default="cpu", help="where the hf engine runs the target")
    ap.add_argument("--tol", type=float, default=2**-7,
                    help="largest per-token difference, by the state's scale, that agrees "
                         "(2^-7: the two straddle one bf16 rounding step of the stored value)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    server = ServerConfig(command=args.server_command, extra_args=args.extra_args,
                          concurrency=args.concurrency)
    out = {**run_info(torch.device(args.device), None), "torch_threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count(), "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for engine in ("hf", "vllm"):
            r = run_engine(engine, args.repo.resolve(), tmp, server, args.device)
            out["results"].append(r)
            print(json.dumps(r))
        out["artifacts"] = compare(tmp / "hf", tmp / "vllm", args.tol)
    hf, vllm = out["results"]
    out["vllm_over_hf"] = round(vllm["tokens_per_s"] / hf["tokens_per_s"], 3)
    print(json.dumps({k: v for k, v in out["artifacts"].items() if k != "per_layer"}))
    for name, v in out["artifacts"]["per_layer"].items():
        print(f"{name:>9}: max {v['max_diff_of_scale']:.2e} of scale, p99 "
              f"{v['p99_diff_of_scale']:.2e}, {v['tokens_over_tol']}/{v['tokens']} tokens over "
              f"{args.tol:.2e}")
    print(f"vllm / hf tokens/s (startup excluded): {out['vllm_over_hf']}")
    save_results(args.json, out)


if __name__ == "__main__":
    main()
