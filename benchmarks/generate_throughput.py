"""Generation throughput: the in-process backend against a live vLLM at several concurrencies,
measured side by side in one run on the same prompts (and checked to give the same records).

    python benchmarks/generate_throughput.py --target models/target \\
        --command "$VLLM_PY src/draftsmith/serving/vllm_cpu.py serve {model}" --samples 300

Tokens/s counts response tokens over generation time only (model load and server start
excluded; the start is reported apart).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from draftsmith import generate
from draftsmith.atomic import read_jsonl
from draftsmith.config import GenerateConfig, ServerConfig
from draftsmith.serving.server import serve_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("models/target"))
    ap.add_argument("--command", default=None, help="server launch command with {model}")
    ap.add_argument("--extra-args", default="", help="e.g. --enforce-eager")
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gen-bench-"))
    cfg = GenerateConfig(num_samples=args.samples)
    rows = []
    local = generate.run(cfg, args.target, work / "inprocess")
    rows.append(("inprocess", f"batch {cfg.batch_size}", local["tokens_per_s"]))
    reference = read_jsonl(work / "inprocess" / generate.SAMPLES_FILE)
    server = ServerConfig(command=args.command, extra_args=args.extra_args)
    with serve_target(server, args.target, work / "server", seed=cfg.seed, launch=True) as urls:
        for c in args.concurrency:
            out = work / f"vllm-c{c}"
            m = generate.run(cfg.model_copy(update={"backend": "openai"}), args.target, out,
                             server.model_copy(update={"urls": urls, "concurrency": c}),
                             out / "work")
            same = sum(a == b for a, b in zip(read_jsonl(out / generate.SAMPLES_FILE), reference))
            rows.append(("vllm", f"concurrency {c}", m["tokens_per_s"], f"{same}/{len(reference)}"))

    base = rows[0][2]
    print(f"\n{args.samples} samples, {local['total_response_tokens']} response tokens")
    print(f"{'backend':10} {'setting':16} {'tokens/s':>9} {'vs inprocess':>13} {'same records':>13}")
    for row in rows:
        same = row[3] if len(row) > 3 else "-"
        print(f"{row[0]:10} {row[1]:16} {row[2]:9.1f} {row[2] / base:12.2f}x {same:>13}")


if __name__ == "__main__":
    main()
