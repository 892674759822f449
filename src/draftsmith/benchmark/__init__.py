"""Benchmark stage: acceptance of the trained drafter on held-out prompts.

Held out means: prompts whose stable ids never occur in the generated training data (checked,
not assumed). The same prompts run with a randomly initialised drafter of the same shape, so the
metric visibly measures the drafter rather than the prompts.

Engines: `reference` (speculative.py, in this process, exact by construction) and each served
engine with acceptance counters (serving/engines.py: `vllm`, the exported drafter served by a
real vLLM, acceptance read from its `/metrics` counters). All run on the same prompts and k, so
their figures compare directly.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.artifacts import SAMPLES_FILE
from draftsmith.atomic import read_jsonl
from draftsmith.config import BenchmarkConfig, ServerConfig
from draftsmith.drafters.registry import DrafterConfig, build, method_of
from draftsmith.errors import DraftsmithError
from draftsmith.benchmark.lossless import check_greedy, check_sampled
from draftsmith.prompts import builtin_prompts, load_prompts
from draftsmith.render import prompt_text
from draftsmith.serving.engines import ENGINES, REFERENCE
from draftsmith.speculative import measure


def held_out_prompts(cfg: BenchmarkConfig, raw_dir: Path):
    train_ids = {r["id"] for r in read_jsonl(Path(raw_dir) / SAMPLES_FILE)}
    if cfg.source == "builtin":
        candidates = builtin_prompts(cfg.num_prompts * 3, cfg.seed, "benchmark")
    else:
        candidates = load_prompts(cfg.source, split=cfg.split, fmt="auto", column=None,
                                  limit=cfg.num_prompts * 3, seed=cfg.seed)
    prompts, seen, excluded = [], set(), 0
    for p in candidates:
        if len(prompts) == cfg.num_prompts:
            break
        if p.id in train_ids:
            excluded += 1  # a training prompt: never benchmarked on
        elif p.id not in seen:
            seen.add(p.id)
            prompts.append(p)
    if len(prompts) < cfg.num_prompts:
        raise DraftsmithError(
            f"only {len(prompts)} benchmark prompts are not in the training data "
            f"({cfg.num_prompts} asked)", "lower benchmark.num_prompts or use another source")
    assert not {p.id for p in prompts} & train_ids  # the held-out guarantee, checked
    return prompts, excluded


def random_drafter(trained, seed: int):
    """Same method and shape, vocab map and the tensors shared with the target; every trained
    weight random. Initialised on the CPU (the same weights on any device), then put where
    `trained` is."""
    torch.manual_seed(seed)
    d = build(DrafterConfig.from_dict(trained.config.to_dict()))
    for name in trained.SHARED:
        d.get_parameter(name).data.copy_(trained.get_parameter(name))
    for name, buffer in trained.named_buffers():  # the vocab maps
        d.get_buffer(name).copy_(buffer)
    return d.to(trained.fc.weight).eval()


def run(cfg: BenchmarkConfig, target_dir: Path, drafter_dir: Path, raw_dir: Path,
        plot_file: Path | None = None, *, export_dir: Path | None = None,
        server: ServerConfig | None = None, work_dir: Path | None = None,
        device: str | None = None) -> dict:
    """Measure acceptance with each engine in `cfg.engines` on the same held-out prompts.
    The top-level keys are the first engine's; `by_engine` holds every engine's. The
    reference engine runs on `device` (None: CUDA when there is one, else the CPU)."""
    from draftsmith.target_info import read_info

    from draftsmith.checkpoint import read_drafter_config

    info = read_info(target_dir)
    drafter = read_drafter_config(drafter_dir)
    method_of(drafter).check_k(drafter, cfg.num_speculative_tokens)  # before any work
    prompts, excluded = held_out_prompts(cfg, raw_dir)
    for engine in cfg.engines:
        if engine != REFERENCE:
            _check_served_setup(server or ServerConfig(), export_dir, engine)
    judge = TargetJudge(cfg, target_dir, prompts, device)
    by_engine, baseline = {}, None
    for engine in cfg.engines:
        if engine == REFERENCE:
            results, baseline = reference_acceptance(cfg, judge, drafter_dir)
        else:
            results, outputs = served_acceptance(cfg, server or ServerConfig(), target_dir,
                                                 Path(export_dir) / engine, prompts,
                                                 Path(work_dir or "data/benchmark.work"),
                                                 longest=max(map(len, judge.prompt_ids)))
            for r in results:
                ids = [outputs[r["temperature"]][p.id] for p in prompts]
                r["lossless"] = judge.verdict(ids, r["temperature"])
        by_engine[engine] = results
    broken = {e: [r["temperature"] for r in rs if r["lossless"]["lossless"] is False]
              for e, rs in by_engine.items()}
    broken = {e: ts for e, ts in broken.items() if ts}
    for engine, temps in broken.items():
        print(f"benchmark: {engine} IS NOT LOSSLESS at T={temps}: its outputs are not the "
              "target's own (evidence under results[].lossless in metrics/benchmark.json), so "
              "its acceptance figures there are not a speed-up of this target")
    gaps = engine_gaps(by_engine)
    se = {r["temperature"]: r.get("acceptance_length_se") for r in by_engine.get(REFERENCE, [])}
    for line in gap_warnings(gaps, se):
        print(line)
    if plot_file:
        from draftsmith.plots import plot_acceptance

        plot_acceptance(by_engine, baseline, plot_file)
    first = by_engine[cfg.engines[0]]
    greedy = next((r for r in first if r["temperature"] == 0), first[0])
    metrics = {
        "method": drafter.method,
        "acceptance_length": greedy["acceptance_length"],
        # How far it moves with other prompts (the reference engine's; None for a served one)
        "acceptance_length_se": greedy.get("acceptance_length_se"),
        "acceptance_rate_per_position": greedy["acceptance_rate_per_position"],
        "k": cfg.num_speculative_tokens,
        "samples": len(prompts),
        "excluded_training_prompts": excluded,
        "engine": cfg.engines[0],
        "results": first,
        # One row per engine and temperature: what `dvc metrics show` puts side by side.
        # (an engine whose outputs are not the target's shows "not lossless", not a figure)
        "by_engine": {e: {f"T{r['temperature']}": "not lossless"
                          if r["lossless"]["lossless"] is False else r["acceptance_length"]
                          for r in rs} for e, rs in by_engine.items()},
        "not_lossless": broken,
        "by_engine_results": {e: rs for e, rs in by_engine.items() if e != cfg.engines[0]},
        "target": info.model,
        # Temperatures where the engines differ by more than 10% (empty: they agree).
        "engines_disagree_at": sorted(gaps),
    }
    if baseline:
        metrics["random_drafter_acceptance_length"] = baseline["acceptance_length"]
    return metrics


def engine_gaps(by_engine: dict[str, list[dict]], tolerance: float = 0.10) -> dict:
    """{temperature: {engine: acceptance length}} where engines differ by more than
    `tolerance` (relative to the smallest)."""
    at: dict[float, dict[str, float]] = {}
    for engine, results in by_engine.items():
        for r in results:
            at.setdefault(r["temperature"], {})[engine] = r["acceptance_length"]
    return {t: v for t, v in at.items()
            if len(v) > 1 and max(v.values()) > (1 + tolerance) * min(v.values())}


def gap_warnings(gaps: dict, se: dict | None = None) -> list[str]:
    """What to tell the user about engine_gaps' temperatures. At T = 0 the engines see the same
    texts, so a gap is the engine's doing. At T > 0 each samples its own, so two engines that
    sample alike still differ by sampling: about sqrt(2) times the reference's standard error
    over prompts (`se`, by temperature; each engine's own spread taken as the reference's). A
    gap within twice that is called noise; one beyond it, or with no error known, is not. The
    error over prompts somewhat exceeds what the seed alone moves on fixed prompts (the MLA toy:
    0.120 against an sd of 0.096 over 8 seeds, benchmarks/results/reference_seeds_cpu_mla.json),
    so the bound errs towards calling a gap noise by that much."""
    lines, se = [], se or {}
    for temp, values in gaps.items():
        gap = max(values.values()) - min(values.values())
        noise = 2 * math.sqrt(2) * se[temp] if temp > 0 and se.get(temp) else None
        if noise is not None and gap <= noise:
            lines.append(f"benchmark: engines differ at T={temp}: {values} (acceptance length), "
                         f"within sampling noise: two engines that sample alike differ by up to "
                         f"{noise:.3f} at 2 sigma here (the reference's standard error over "
                         f"prompts {se[temp]}); more prompts narrow it")
            continue
        if temp == 0:
            why = "an engine is not running this drafter as trained"
        elif noise is not None:
            why = (f"more than sampling explains (up to {noise:.3f} at 2 sigma): an engine is "
                   "not running this drafter as trained, or not sampling as specified (vLLM's "
                   "greedy drafts at T > 0: docs/serving.md)")
        else:
            why = ("each engine samples its own texts, so this may be sampling noise (more "
                   "prompts, or benchmarks/reference_seeds.py's spread, tell); else an engine "
                   "is not running this drafter as trained, or not sampling as specified")
        lines.append(f"benchmark: WARNING engines disagree at T={temp}: {values} (acceptance "
                     f"length); {why}")
    return lines


class TargetJudge:
    """The target in process, on the benchmark's prompts: runs the reference engine and judges
    every engine's outputs against the target itself (lossless.py). Loaded once per run."""

    def __init__(self, cfg: BenchmarkConfig, target_dir: Path, prompts, device: str | None):
        from draftsmith.target_info import load_model, load_tokenizer, read_info

        self.cfg = cfg
        tokenizer = load_tokenizer(target_dir)
        self.model = load_model(target_dir, device=device)
        if self.model.device.type == "cpu":
            self.model = self.model.float()  # CPU kernels for bf16/fp16 are slow, or missing
        self.prompt_ids = [tokenizer(prompt_text(tokenizer, p.messages, cfg.thinking),
                                     add_special_tokens=False)["input_ids"] for p in prompts]
        self.eos = tokenizer.convert_tokens_to_ids(read_info(target_dir).format.end_of_turn)
        self._greedy: list[list[int]] | None = None

    def greedy(self) -> list[list[int]]:
        """The target alone, greedy, through transformers' own generate: the T=0 reference,
        from code that shares nothing with the speculative engines."""
        if self._greedy is None:
            self._greedy = []
            for ids in tqdm(self.prompt_ids, desc="benchmark target alone", unit="prompt"):
                x = torch.tensor([ids], device=self.model.device)
                y = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                        max_new_tokens=self.cfg.max_new_tokens,
                                        eos_token_id=self.eos, pad_token_id=self.eos)
                y = y[0, len(ids):].tolist()
                self._greedy.append(y[: y.index(self.eos) + 1] if self.eos in y else y)
        return self._greedy

    def load_drafter(self, drafter_dir: Path):
        """The trained drafter, on the target's device and in its dtype."""
        from draftsmith.checkpoint import load_drafter

        return load_drafter(drafter_dir, self.model).to(self.model.device, self.model.dtype)

    def speculate(self, drafter, temperature: float, seed: int, desc: str
                  ) -> tuple[dict, list[list[int]]]:
        """The reference engine with `drafter` on these prompts: its summary and outputs."""
        return measure(self.model, method_of(drafter.config).proposer(drafter), self.prompt_ids,
                       k=self.cfg.num_speculative_tokens,
                       aux_layers=list(drafter.config.aux_layers),
                       max_new_tokens=self.cfg.max_new_tokens, eos_id=self.eos,
                       temperature=temperature, seed=seed, desc=desc)

    def verdict(self, outputs: list[list[int]], temperature: float) -> dict:
        """Are these outputs (token ids, one list per prompt) the target's own at
        `temperature`?"""
        if temperature == 0:
            return check_greedy(self.model, self.prompt_ids, self.greedy(), outputs)
        return check_sampled(self.model, self.prompt_ids, outputs, temperature,
                             seed=self.cfg.seed)


def reference_acceptance(cfg: BenchmarkConfig, judge: TargetJudge, drafter_dir: Path
                         ) -> tuple[list[dict], dict]:
    """The reference engine (speculative.py) at each temperature, plus a random drafter, on
    the judge's target (its device and dtype)."""
    drafter = judge.load_drafter(drafter_dir)
    results = []
    for temp in cfg.temperatures:
        t0 = time.time()
        summary, outputs = judge.speculate(drafter, temp, cfg.seed, f"benchmark T={temp}")
        results.append({"temperature": temp, **summary, "wall_s": round(time.time() - t0, 1),
                        "lossless": judge.verdict(outputs, temp)})
    baseline, _ = judge.speculate(random_drafter(drafter, cfg.seed), 0.0, cfg.seed,
                                  "benchmark random drafter")
    return results, baseline


def _check_served_setup(server: ServerConfig, export_dir: Path | None, engine: str) -> None:
    if server.engine != engine:
        raise DraftsmithError(
            f"benchmark.engines lists '{engine}' but server.engine is '{server.engine}'",
            f"set server.engine: {engine} (one served engine per run; see docs/serving.md)")
    if export_dir is None or not (Path(export_dir) / engine / "config.json").exists():
        raise DraftsmithError(f"no {ENGINES[engine].label} export under {export_dir}",
                              "run the export stage first (`dvc repro export`)")


def served_acceptance(cfg: BenchmarkConfig, server: ServerConfig, target_dir: Path,
                      draft_dir: Path | None, prompts, work_dir: Path,
                      longest: int | None = None) -> tuple[list[dict], dict]:
    """Serve the target with the exported drafter in `server.engine`, send the prompts at each
    temperature, and read acceptance from the engine's counters. Returns the per-temperature
    results and the outputs ({temperature: {prompt id: emitted token ids}}). No draft_dir:
    the target alone, no counters (what the engine's own numerics give without a drafter).
    Acceptance comes from the engine's /metrics counters (vLLM) or from each response's own
    counts (SGLang), as its entry in serving/engines.py says. longest: the longest prompt's
    tokens; the engine's KV cache is then sized for it (serving/memory.py), the drafter's own
    KV included."""
    from draftsmith.export import speculative_args
    from draftsmith.serving.acceptance import Counters
    from draftsmith.serving.client import ChatClient, ChatRequest
    from draftsmith.serving.server import serve_target
    from draftsmith.target_info import read_info

    k = cfg.num_speculative_tokens
    fmt = read_info(target_dir).format
    engine = ENGINES[server.engine]
    per_response = engine.spec_response is not None and draft_dir is not None
    scraped = engine.spec_metrics is not None and draft_dir is not None
    results, outputs = [], {}
    extra = speculative_args(server.engine, draft_dir, k, server.speculative_config) \
        if draft_dir else []
    need = None
    if longest is not None:
        from draftsmith.serving.memory import EngineNeed, kv_bytes_per_token

        drafter_kv = kv_bytes_per_token(json.loads((Path(draft_dir) / "config.json").read_text()),
                                        getattr(torch, read_info(target_dir).dtype).itemsize) \
            if draft_dir else 0
        # The target that judges the outputs is loaded already: nothing more of the stage's.
        need = EngineNeed("benchmark", longest + cfg.max_new_tokens + k + 1,
                          extra_bytes_per_token=drafter_kv)
    with serve_target(server, target_dir, work_dir, seed=cfg.seed, launch=True,
                      extra=extra, need=need) as urls:
        client = ChatClient(server, urls, fmt)
        try:
            for temp in cfg.temperatures:
                # Token ids come back with the text, so the judge reads exactly what was
                # emitted; an engine that counts per response is asked for its counts.
                body = {"max_tokens": cfg.max_new_tokens, "temperature": temp,
                        **engine.token_id_fields,
                        **(engine.spec_response.request if per_response else {}),
                        "chat_template_kwargs": {"enable_thinking": cfg.thinking}}
                reqs = [ChatRequest(p.id, p.messages, {**body, "seed": cfg.seed + i})
                        for i, p in enumerate(prompts)]
                t0 = time.time()
                before = Counters.scrape(urls[0], k, server.engine) if scraped else None
                outs = {r.id: o for r, o in tqdm(client.stream(reqs), total=len(reqs),
                                                 desc=f"{server.engine} T={temp}",
                                                 unit="prompt")}
                wall = time.time() - t0
                if scraped:
                    summary = (Counters.scrape(urls[0], k, server.engine) - before).summary()
                elif per_response:
                    summary = Counters.from_responses(
                        [o.extras or {} for o in outs.values()], k, server.engine).summary()
                else:
                    summary = {}
                tokens = sum(o.num_tokens for o in outs.values())
                results.append({"temperature": temp, **summary, "wall_s": round(wall, 1),
                                "tokens_per_s": round(tokens / wall, 1)})
                outputs[temp] = {i: o.token_ids for i, o in outs.items()}
                if any(ids is None for ids in outputs[temp].values()):
                    raise DraftsmithError(
                        "the server returned no token ids with its outputs, so they cannot be "
                        "checked against the target",
                        f"serve with a {engine.label} release that honours "
                        f"{sorted(engine.token_id_fields)}")
        finally:
            client.close()
    return results, outputs
