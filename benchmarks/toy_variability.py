"""Do the toys the pipeline and the tests train clear their thresholds on any CPU?

A toy target trained on one machine must pass the same checks on another. What differs between
machines is the float order of the kernels (CPU type, thread count), so each toy is trained
here over what varies: torch thread counts 1 and 2, and several seeds (each seed changes the
init, the data order and the float order at once: a stand-in for another CPU type). For each
run the table records what the pipeline's checks read:

- malformed share: greedy completions of held-out prompts that break the toy's own chat format
  (tokenize refuses past `tokenize.max_malformed_share`, 0.25);
- held-out loss: the toy's loss on held-out chats (`metrics/target.json`; the e2e test wants < 3).

A toy passes when its worst run keeps half of each threshold as margin.

    python benchmarks/toy_variability.py --json benchmarks/results/toy_variability.json
    python benchmarks/toy_variability.py --toys tiny-mla --seeds 0 1 --threads 2   # one toy

Each run is a fresh process (thread count and float order are per process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draftsmith.toy.recipes import TOYS as TEST_TOYS  # the recipes the tests train: one source

REPO = Path(__file__).resolve().parents[1]


def _default_toy() -> dict:
    """The embedded default as params.yaml has it (what `make repro` trains)."""
    import yaml

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    # `device` says where it trains, not what: these runs are the CPU's, as the default's
    embedded = {k: v for k, v in params["target"]["embedded"].items() if k != "device"}
    return {"embedded": embedded, "mla": False,
            "max_new_tokens": params["generate"]["max_new_tokens"]}


TOYS = {"default": _default_toy(), **TEST_TOYS}

# What the pipeline accepts; a toy passes with half of each as margin.
THRESHOLDS = {"malformed_share": 0.25, "heldout_loss": 3.0}
MARGIN = 0.5


def run_one(toy: str, seed: int, threads: int, prompts: int, steps: int | None = None) -> dict:
    """Train `toy` with `seed` on `threads` threads, then sample its held-out prompts."""
    import torch

    torch.set_num_threads(threads)
    from draftsmith.config import EmbeddedTargetConfig
    from draftsmith.inprocess import complete
    from draftsmith.prompts import builtin_prompts
    from draftsmith.render import prompt_text
    from draftsmith.toy import build
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = TOYS[toy]
    cfg = EmbeddedTargetConfig(**{**recipe["embedded"], "seed": seed,
                                  **({"train_steps": steps} if steps else {})})
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        metrics = build.build(cfg, Path(d), mla=recipe["mla"])
        train_s = time.time() - t0
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        tok = AutoTokenizer.from_pretrained(d)
    # The generate stage's prompts: held out from training, drawn as it draws them.
    texts = [prompt_text(tok, p.messages, True) for p in builtin_prompts(prompts, seed, "generate")]
    outs = complete(model, tok, texts, eos_token_id=model.config.eos_token_id,
                    max_new_tokens=recipe["max_new_tokens"], batch_size=64)
    finished = [o for o in outs if o.finish_reason == "stop"]
    malformed = sum(not build.FORMAT.well_formed(o.text, thinking=True) for o in finished)
    return {"toy": toy, "seed": seed, "threads": threads, "train_s": round(train_s, 1),
            "heldout_loss": metrics["heldout_loss"],
            "malformed_share": round(malformed / max(1, len(finished)), 4),
            "finished_share": round(len(finished) / len(outs), 4),
            "answer_accuracy": metrics["answer_accuracy"]}


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for toy in dict.fromkeys(r["toy"] for r in rows):
        mine = [r for r in rows if r["toy"] == toy]
        worst = {k: max(r[k] for r in mine) for k in THRESHOLDS}
        out.append({"toy": toy, "runs": len(mine), **{f"worst_{k}": v for k, v in worst.items()},
                    "passes_with_margin": all(worst[k] <= MARGIN * t for k, t in THRESHOLDS.items())})
    return out


def markdown(rows: list[dict], summary: list[dict]) -> str:
    """The table a reader compares their machine with: every run, then each toy's worst."""
    cols = ["toy", "threads", "seed", "heldout_loss", "malformed_share", "finished_share"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    limits = ", ".join(f"{k} {MARGIN * t:g}" for k, t in THRESHOLDS.items())
    lines += ["", f"Worst run per toy (passes when every worst is within half its threshold: {limits}):",
              "", "| toy | runs | worst held-out loss | worst malformed share | passes |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {s['toy']} | {s['runs']} | {s['worst_heldout_loss']} | "
              f"{s['worst_malformed_share']} | {'yes' if s['passes_with_margin'] else 'NO'} |"
              for s in summary]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--toys", nargs="+", default=list(TOYS), choices=list(TOYS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompts", type=int, default=200, help="held-out prompts sampled per run")
    ap.add_argument("--cores", type=int, default=os.cpu_count(),
                    help="cores the runs share (a run takes one per thread)")
    ap.add_argument("--steps", type=int, help="override the toys' training steps (a smoke test)")
    ap.add_argument("--json", type=Path, help="write the rows and the summary here")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    ap.add_argument("--one", nargs=3, metavar=("TOY", "SEED", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        toy, seed, threads = args.one
        print(json.dumps(run_one(toy, int(seed), int(threads), args.prompts, args.steps)))
        return

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    # Resumable: rows already in --json for the same recipe are kept (the full table is 24
    # runs, the default toy's taking minutes each), and the file is rewritten after every run.
    kept = _kept_rows(args.json, args.toys) if args.json and not args.steps else []
    rows, lock = list(kept), threading.Lock()

    # A run takes as many cores as it has threads, and never shares one: torch's OpenMP threads
    # spin at every barrier, and two 2-thread runs on two cores took ten times as long.
    cores, free = args.cores, threading.Condition()
    busy = [0]

    def one(run: tuple[str, int, int]) -> None:
        toy, threads, seed = run
        with free:
            free.wait_for(lambda: busy[0] + threads <= max(cores, threads))
            busy[0] += threads
        try:
            _run(toy, threads, seed)
        finally:
            with free:
                busy[0] -= threads
                free.notify_all()

    def _run(toy: str, threads: int, seed: int) -> None:
        proc = subprocess.run([sys.executable, __file__, "--one", toy, str(seed), str(threads),
                               "--prompts", str(args.prompts),
                               *(["--steps", str(args.steps)] if args.steps else [])],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            raise RuntimeError(f"{toy} seed {seed} threads {threads} failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(row), flush=True)
        with lock:
            rows.append(row)
            if args.json:
                _write(args.json, args, rows)

    done = {(r["toy"], r["threads"], r["seed"]) for r in kept}
    runs = [(t, n, s) for t in args.toys for n in args.threads for s in args.seeds
            if (t, n, s) not in done]
    # Runs are independent processes: the float order depends on each one's thread count, not
    # on what else the machine runs, so runs side by side give the rows a lone run would.
    with ThreadPoolExecutor(max(1, args.cores)) as pool:
        list(pool.map(one, runs))
    order = {(t, n, s): i for i, (t, n, s) in enumerate(
        (t, n, s) for t in args.toys for n in args.threads for s in args.seeds)}
    rows.sort(key=lambda r: order.get((r["toy"], r["threads"], r["seed"]), len(order)))
    if args.json:
        _write(args.json, args, rows)
    print(markdown(rows, summarize(rows)))
    if args.markdown:
        args.markdown.write_text(markdown(rows, summarize(rows)))


def _kept_rows(path: Path, toys: list[str]) -> list[dict]:
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    same = {t for t in toys if json.loads(json.dumps(TOYS[t])) == old["recipes"].get(t)}
    return [r for r in old["rows"] if r["toy"] in same]


def _write(path: Path, args, rows: list[dict]) -> None:
    toys = list(dict.fromkeys(r["toy"] for r in rows))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(
        {"command": "python benchmarks/toy_variability.py " + " ".join(sys.argv[1:]),
         "thresholds": THRESHOLDS, "margin": MARGIN, "cpu": _cpu(), "torch": _torch_version(),
         "recipes": {t: TOYS[t] for t in toys}, "rows": rows, "summary": summarize(rows)},
        indent=2) + "\n")
    tmp.replace(path)


def _torch_version() -> str:
    import torch

    return torch.__version__


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


if __name__ == "__main__":
    main()
