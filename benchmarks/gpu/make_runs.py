"""Build the two toys `benchmarks/gpu/check.sh RUN` serves, on the CPU, from this checkout:

    python benchmarks/gpu/make_runs.py RUN            # RUN/llama and RUN/mla
    python benchmarks/gpu/make_runs.py RUN --only llama --methods dspark:train.dflash.block_size=3

- RUN/llama: the embedded default (params.yaml as committed) with one drafter per method in
  `drafters/<method>/{drafter,export}`, each made by `dvc repro export` with only the method
  (and the variant's params) changed: the same target, data and hidden states for all of them.
- RUN/mla: an MLA + MoE toy (DeepSeek-V3 layout) with DeepSeek's head dims (head_dim 128:
  qk_nope 128, rope 64, v 128, the only kind GPU vLLM's MLA prefill takes; docs/gpu.md) and its
  MLA EAGLE-3 drafter in models/. Trained here in float32; its target.json says bfloat16, the
  dtype both GPU engines run it in (no GPU MLA backend takes float32).

Each toy is a scratch checkout sharing this repo's DVC cache, so a stage already run with the
same code and params comes back from DVC's run cache. Only what serving reads is kept
(params.yaml, models/target, data/raw and the drafters): a few MB, carried to the GPU host.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "src"))

from methods import dvc, scratch_checkout, set_params  # noqa: E402

# DSpark drafts k = block_size tokens from its block; the benchmark's k is 3
LLAMA_METHODS = ("eagle3", "eagle3.1", "dflash", "p-eagle", "dspark:train.dflash.block_size=3")
MLA_PARAMS = ["target.model=embedded-mla", "target.embedded.num_layers=7",
              "target.embedded.head_dim=128", "target.embedded.train_steps=1200",
              "generate.num_samples=300", "train.drafter_arch=mla", "train.steps=300",
              "benchmark.num_prompts=30",
              # its 1,200 steps leave answers often cut off or unwrapped (44 of 91 finished
              # samples, 2026-12-06): keep what is well formed rather than stop
              "tokenize.max_malformed_share=0.6"]
KEEP = ("params.yaml", "models/target", "data/raw")


def keep(src: Path, dest: Path, extra: dict[str, str]) -> None:
    """What serving reads, copied out of the scratch checkout (extra: src path -> dest path)."""
    for rel in KEEP:
        (shutil.copytree if (src / rel).is_dir() else shutil.copy2)(src / rel, dest / rel)
    for s, d in extra.items():
        shutil.copytree(src / s, dest / d)


def build_llama(dest: Path, cache: Path, methods: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repo = scratch_checkout(Path(tmp), cache)
        params = (repo / "params.yaml").read_text()
        for spec in methods:
            method, _, extra = spec.partition(":")
            (repo / "params.yaml").write_text(params)
            set_params(repo, [f"train.method={method}", *(e for e in extra.split(";") if e)])
            dvc(repo, "repro", "export")
            out = dest / "drafters" / method
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            shutil.copytree(repo / "models/drafter", out / "drafter")
            shutil.copytree(repo / "models/export", out / "export")
            shutil.copy2(repo / "params.yaml", out / "params.yaml")  # what trained it
            print(f"llama: {spec} -> {out}", flush=True)
        (repo / "params.yaml").write_text(params)
        if not (dest / "models/target").exists():
            keep(repo, dest, {})


def build_mla(dest: Path, cache: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repo = scratch_checkout(Path(tmp), cache)
        set_params(repo, MLA_PARAMS)
        dvc(repo, "repro", "export")
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        keep(repo, dest, {"models/drafter": "models/drafter", "models/export": "models/export"})
    meta = dest / "models/target/target.json"
    info = json.loads(meta.read_text())
    info["dtype"] = "bfloat16"  # what the GPU engines run it in
    meta.write_text(json.dumps(info, indent=2) + "\n")
    set_params(dest, ["target.dtype=bfloat16"])
    print(f"mla -> {dest}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="the folder to hold llama/ and mla/")
    p.add_argument("--only", choices=("llama", "mla"))
    p.add_argument("--methods", nargs="+", default=list(LLAMA_METHODS),
                   help="the Llama toy's drafters: METHOD or METHOD:KEY=VALUE[;KEY=VALUE]")
    p.add_argument("--cache", type=Path, default=REPO / ".dvc" / "cache")
    a = p.parse_args(argv)
    if a.only != "mla":
        build_llama(a.run / "llama", a.cache, a.methods)
    if a.only != "llama":
        build_mla(a.run / "mla", a.cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
