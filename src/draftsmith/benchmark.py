"""Benchmark stage: acceptance of the trained drafter on held-out prompts.

Held out means: prompts whose stable ids never occur in the generated training data (checked,
not assumed). The same prompts run with a randomly initialised drafter of the same shape, so the
metric visibly measures the drafter rather than the prompts.

Engines: `reference` (speculative.py, in this process, exact by construction) and `vllm` (the
exported drafter served by a real vLLM, acceptance read from its `/metrics` counters). Both
run on the same prompts and k, so their figures compare directly.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.atomic import read_jsonl
from draftsmith.config import BenchmarkConfig, ServerConfig
from draftsmith.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.errors import DraftsmithError
from draftsmith.generate import SAMPLES_FILE
from draftsmith.prompts import builtin_prompts, load_prompts
from draftsmith.render import prompt_text
from draftsmith.speculative import Eagle3Proposer, SpecStats, generate


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


def measure(model, proposer, prompts_ids, *, k, aux_layers, max_new_tokens, eos_id, temperature,
            seed: int, desc: str) -> tuple[dict, list[list[int]]]:
    total = SpecStats(accepted_at=[0] * k, reached=[0] * k)
    outputs = []
    for i, ids in enumerate(tqdm(prompts_ids, desc=desc, unit="prompt")):
        gen = torch.Generator(model.device).manual_seed(seed * 1_000_003 + i)
        out, stats = generate(model, proposer, ids, k=k, aux_layers=aux_layers,
                              max_new_tokens=max_new_tokens, eos_id=eos_id,
                              temperature=temperature, gen=gen)
        total.add(stats)
        outputs.append(out)
    return total.summary(), outputs


def random_drafter(trained: Eagle3Drafter, seed: int) -> Eagle3Drafter:
    """Same shape, vocab map and (frozen, shared) embeddings; every trained weight random.
    Initialised on the CPU (the same weights on any device), then put where `trained` is."""
    torch.manual_seed(seed)
    d = Eagle3Drafter(DrafterConfig(**{**trained.config.to_dict(),
                                       "aux_layers": trained.config.aux_layers}))
    d.embed_tokens.weight.data.copy_(trained.embed_tokens.weight)
    d.d2t.copy_(trained.d2t)
    d.t2d.copy_(trained.t2d)
    return d.to(trained.fc.weight).eval()


def run(cfg: BenchmarkConfig, target_dir: Path, drafter_dir: Path, raw_dir: Path,
        plot_file: Path | None = None, *, export_dir: Path | None = None,
        server: ServerConfig | None = None, work_dir: Path | None = None,
        device: str | None = None) -> dict:
    """Measure acceptance with each engine in `cfg.engines` on the same held-out prompts.
    The top-level keys are the first engine's; `by_engine` holds every engine's. The
    reference engine runs on `device` (None: CUDA when there is one, else the CPU)."""
    from draftsmith.target import read_info

    info = read_info(target_dir)
    prompts, excluded = held_out_prompts(cfg, raw_dir)
    if "vllm" in cfg.engines:
        _check_vllm_setup(server or ServerConfig(), export_dir)
    by_engine, baseline = {}, None
    for engine in cfg.engines:
        if engine == "reference":
            results, baseline = reference_acceptance(cfg, target_dir, drafter_dir, prompts,
                                                     device)
        else:
            results, _ = vllm_acceptance(cfg, server or ServerConfig(), target_dir,
                                         Path(export_dir) / "vllm", prompts,
                                         Path(work_dir or "data/benchmark.work"))
        by_engine[engine] = results
    gaps = engine_gaps(by_engine)
    for temp, values in gaps.items():
        print(f"benchmark: WARNING engines disagree at T={temp}: {values} (acceptance length); "
              "an engine is not running this drafter as trained, or not sampling as specified")
    if plot_file:
        from draftsmith.plots import plot_acceptance

        plot_acceptance(by_engine, baseline, plot_file)
    first = by_engine[cfg.engines[0]]
    greedy = next((r for r in first if r["temperature"] == 0), first[0])
    metrics = {
        "acceptance_length": greedy["acceptance_length"],
        "acceptance_rate_per_position": greedy["acceptance_rate_per_position"],
        "k": cfg.num_speculative_tokens,
        "samples": len(prompts),
        "excluded_training_prompts": excluded,
        "engine": cfg.engines[0],
        "results": first,
        # One row per engine and temperature: what `dvc metrics show` puts side by side.
        "by_engine": {e: {f"T{r['temperature']}": r["acceptance_length"] for r in rs}
                      for e, rs in by_engine.items()},
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


def reference_acceptance(cfg: BenchmarkConfig, target_dir: Path, drafter_dir: Path, prompts,
                         device: str | None = None) -> tuple[list[dict], dict]:
    """The reference engine (speculative.py) at each temperature, plus a random drafter, on
    `device` (None: CUDA when there is one). The drafter takes the target's device and dtype."""
    from draftsmith.artifacts import load_drafter
    from draftsmith.target import load_model, load_tokenizer, read_info

    info = read_info(target_dir)
    tokenizer = load_tokenizer(target_dir)
    model = load_model(target_dir, device=device)
    if model.device.type == "cpu":
        model = model.float()  # CPU kernels for bf16/fp16 are slow, or missing
    drafter = load_drafter(drafter_dir, model.get_input_embeddings().weight)
    drafter = drafter.to(model.device, model.dtype)
    aux_layers = list(drafter.config.aux_layers)
    prompt_ids = [tokenizer(prompt_text(tokenizer, p.messages, cfg.thinking),
                            add_special_tokens=False)["input_ids"] for p in prompts]
    eos = tokenizer.convert_tokens_to_ids(info.format.end_of_turn)
    common = dict(k=cfg.num_speculative_tokens, aux_layers=aux_layers,
                  max_new_tokens=cfg.max_new_tokens, eos_id=eos, seed=cfg.seed)
    results = []
    for temp in cfg.temperatures:
        t0 = time.time()
        summary, _ = measure(model, Eagle3Proposer(drafter), prompt_ids, temperature=temp,
                             desc=f"benchmark T={temp}", **common)
        results.append({"temperature": temp, **summary, "wall_s": round(time.time() - t0, 1)})
    baseline, _ = measure(model, Eagle3Proposer(random_drafter(drafter, cfg.seed)), prompt_ids,
                          temperature=0.0, desc="benchmark random drafter", **common)
    return results, baseline


def _check_vllm_setup(server: ServerConfig, export_dir: Path | None) -> None:
    if server.engine != "vllm":
        raise DraftsmithError(
            f"benchmark.engines lists 'vllm' but server.engine is '{server.engine}'",
            "set server.engine: vllm (SGLang cannot be benchmarked here; see the README)")
    if export_dir is None or not (Path(export_dir) / "vllm" / "config.json").exists():
        raise DraftsmithError(f"no vLLM export under {export_dir}",
                              "run the export stage first (`dvc repro export`)")


def vllm_acceptance(cfg: BenchmarkConfig, server: ServerConfig, target_dir: Path,
                    draft_dir: Path, prompts, work_dir: Path) -> tuple[list[dict], dict]:
    """Serve the target with the exported drafter in vLLM, send the prompts at each
    temperature, and read acceptance from vLLM's counters. Returns the per-temperature
    results and the completions ({temperature: {prompt id: text}})."""
    from draftsmith.serving.acceptance import Counters
    from draftsmith.serving.client import ChatClient, ChatRequest
    from draftsmith.serving.server import serve_target, speculative_args
    from draftsmith.target import read_info

    k = cfg.num_speculative_tokens
    fmt = read_info(target_dir).format
    results, texts = [], {}
    with serve_target(server, target_dir, work_dir, seed=cfg.seed, launch=True,
                      extra=speculative_args("vllm", draft_dir, k)) as urls:
        client = ChatClient(server, urls, fmt)
        try:
            for temp in cfg.temperatures:
                body = {"max_tokens": cfg.max_new_tokens, "temperature": temp,
                        "chat_template_kwargs": {"enable_thinking": cfg.thinking}}
                reqs = [ChatRequest(p.id, p.messages, {**body, "seed": cfg.seed + i})
                        for i, p in enumerate(prompts)]
                t0, before = time.time(), Counters.scrape(urls[0], k)
                outs = {r.id: o for r, o in tqdm(client.stream(reqs), total=len(reqs),
                                                 desc=f"vllm T={temp}", unit="prompt")}
                wall = time.time() - t0
                summary = (Counters.scrape(urls[0], k) - before).summary()
                tokens = sum(o.num_tokens for o in outs.values())
                results.append({"temperature": temp, **summary, "wall_s": round(wall, 1),
                                "tokens_per_s": round(tokens / wall, 1)})
                texts[temp] = {i: o.text for i, o in outs.items()}
        finally:
            client.close()
    return results, texts
