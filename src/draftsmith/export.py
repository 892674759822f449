"""Export the drafter for the engines and validate an export.

One folder per engine of serving/engines.py, each what that engine loads for the drafter's
method (drafters/: EAGLE-3 and 3.1 as vLLM's `llama_eagle3.py` / `deepseek_eagle3.py` and
SGLang read them, DFlash as vLLM's `qwen3_dflash.py`): config.json + model.safetensors with
every tensor but those the engine shares from the target (the embedding table; DFlash's
lm_head too). The weights are the same in every folder; how the config names the aux layers
is the method's, in each engine's convention (EAGLE-3: vLLM's id k = the state entering
target layer k; SGLang reads an id i as the OUTPUT of layer i, so the same tensor is k - 1
there, in `eagle_config` only, and written only where old and new SGLang read it alike;
DFlash: `dflash_config.target_layer_ids` = output of layer i in both).

Each config states its method and convention under `draftsmith`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.atomic import atomic_path, write_json
from draftsmith.checkpoint import drafter_state, load_drafter
from draftsmith.drafters.options import DEFAULT_METHOD
from draftsmith.drafters.registry import METHODS, DrafterConfig, method_of, method_of_export
from draftsmith.errors import DraftsmithError
from draftsmith.readers import read_json_object, read_safetensors
from draftsmith.serving.engines import DEFAULT, ENGINES, Engine


def speculative_args(engine: str, draft_dir: Path, k: int, more: dict | None = None
                     ) -> list[str]:
    """Arguments that make the engine draft with an exported drafter, k tokens a step, by the
    method its config.json is for (`draftsmith.method`, or told by its architecture), named
    in this engine's words: an export made for one engine may be served by another, as
    tests do on purpose. An export no method of ours claims is served as EAGLE-3. `more`:
    server.speculative_config (vLLM's other speculative-config keys)."""
    import json

    e = ENGINES[engine]
    f = Path(draft_dir) / "config.json"
    config = json.loads(f.read_text()) if f.exists() else {}  # none: the engine will say so
    method = method_of_export(config) if isinstance(config, dict) else None
    method = method or METHODS[DEFAULT_METHOD]
    return e.speculative_args(draft_dir, k, method.engine_names[e.name],
                              {**method.speculative_config.get(e.name, {}), **(more or {})})


def _config(c: DrafterConfig, engine: Engine, dtype: str, provenance: dict,
            target_num_layers: int | None) -> dict:
    method = method_of(c)
    own = method.export_config(c, engine)
    return {
        "architectures": [method.architectures[c.arch]],
        **{k: v for k, v in own.items() if k != "draftsmith"},
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "target_hidden_size": c.target_hidden_size,
        # SGLang's DFlash and DSpark size their context from it, and without it take the
        # draft's own layer count ("target_layer_ids contains an out-of-range layer id", seen
        # live on 0.5.17); the other loaders ignore it
        **({"num_target_layers": target_num_layers} if target_num_layers else {}),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "draftsmith": {
            "engine": engine.name,
            "method": c.method,
            "speculative_method": method.engine_names[engine.name],
            "aux_layer_convention": engine.aux_convention,
            "aux_layers_vllm_convention": list(c.aux_layers),
            "aux_capture": "the residual stream entering each layer, before any norm "
                           "(norm_before_fc: false)",
            **own.get("draftsmith", {}),
            **provenance,
        },
    }


def served_by(c: DrafterConfig) -> list[Engine]:
    """The engines that serve a drafter of this method (P-EAGLE: vLLM alone)."""
    return [e for e in ENGINES.values() if e.name in method_of(c).engine_names]


def export(model, out_dir: Path, *, dtype: str = "bfloat16",
           provenance: dict | None = None, target_num_layers: int | None = None) -> None:
    """Write out_dir/<engine> for each engine that serves the method (out_dir/vllm,
    out_dir/sglang)."""
    tensors = drafter_state(model, getattr(torch, dtype))
    with atomic_path(out_dir) as tmp:
        for engine in served_by(model.config):
            d = tmp / engine.name
            d.mkdir(parents=True)
            save_file(tensors, d / "model.safetensors")
            write_json(d / "config.json", _config(model.config, engine, dtype, provenance or {},
                                                  target_num_layers))


# ----------------------------------------------------------------------------- validate


def validate(export_dir: Path, *, target_num_layers: int, target_hidden_size: int,
             target_vocab_size: int) -> dict:
    """Check an engine export against the target. Raises DraftsmithError listing every
    problem; returns a summary when it passes."""
    export_dir = Path(export_dir)
    problems: list[str] = []
    fix = "re-export with `dvc repro export`, or point at the folder holding config.json"
    cfg_file, w_file = export_dir / "config.json", export_dir / "model.safetensors"
    for f in (cfg_file, w_file):
        if not f.exists():
            raise DraftsmithError(f"{export_dir}: {f.name} is missing", fix)
    c = read_json_object(cfg_file, fix)
    t = read_safetensors(w_file, fix)
    malformed = _malformed(c)
    if malformed:
        raise DraftsmithError(f"{cfg_file} is not a drafter config: " + "; ".join(malformed), fix)
    engine = ENGINES[c.get("draftsmith", {}).get("engine", DEFAULT)]
    method = method_of_export(c)
    if method is None or c.get("architectures") not in [[a] for a in
                                                        method.architectures.values()]:
        known = sorted({a for m in METHODS.values() for a in m.architectures.values()})
        raise DraftsmithError(
            f"{export_dir} is not a valid drafter export: architectures is "
            f"{c.get('architectures')}{f' for method {method.name}' if method else ''}, "
            f"engines load one of {known}", "re-export with `dvc repro export`")
    for key, want in (("vocab_size", target_vocab_size), ("target_hidden_size", target_hidden_size),
                      ("hidden_size", target_hidden_size)):
        if c.get(key) != want:
            problems.append(f"config {key}={c.get(key)} but the target has {want}")
    if c.get("num_target_layers", target_num_layers) != target_num_layers:
        problems.append(f"config num_target_layers={c['num_target_layers']} but the target has "
                        f"{target_num_layers} layers")
    problems += method.check_export(c, t, engine, target_num_layers)
    try:
        shapes = method.expected_shapes(c)
    except (KeyError, TypeError) as e:
        shapes = {}
        problems.append(f"config.json lacks or mistypes {e} (the tensors' shapes follow from it)")
    for name, shape in shapes.items():
        if name not in t:
            problems.append(f"tensor {name} is missing"
                            + (" (without d2t the engine maps draft ids to the first Vd "
                               "target ids and acceptance collapses)" if name == "d2t" else ""))
        elif tuple(t[name].shape) != shape:
            problems.append(f"tensor {name} has shape {tuple(t[name].shape)}, expected {shape}")
    floats = {v.dtype for k, v in t.items() if k not in ("d2t", "t2d")}
    if len(floats) > 1 or not all(d.is_floating_point for d in floats):
        problems.append(f"weights have mixed or non-float dtypes {sorted(map(str, floats))}")
    if "d2t" in t and "t2d" in t and t["d2t"].shape == (c.get("draft_vocab_size"),):
        problems += _check_vocab_map(t["d2t"], t["t2d"])
    if problems:
        raise DraftsmithError(f"{export_dir} is not a valid {method.label} export:\n  - "
                              + "\n  - ".join(problems),
                              "re-export with `dvc repro train`, or fix the listed keys")
    section, key = method.aux_ids_key
    ids = c.get(section, {}).get(key)
    return {"engine": engine.name, "method": method.name, "aux_layer_ids": ids,
            "tensors": len(t), "dtype": str(next(iter(floats)))}


_INT_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
             "vocab_size", "draft_vocab_size", "target_hidden_size", "num_key_value_heads",
             "head_dim", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_ID_LISTS = tuple(sorted({m.aux_ids_key for m in METHODS.values()}))  # (section, key)
_SECTIONS = tuple(sorted({s for s, _ in _ID_LISTS} | {"draftsmith"}))  # each must be an object


def _malformed(c: dict) -> list[str]:
    """Keys of a config.json whose type no engine would take (checked before anything reads
    them): sizes that are not positive integers, sections that are not objects, layer ids
    that are not lists of integers, an engine we do not know."""
    bad = [f"{k} is {c[k]!r}, not a positive integer" for k in _INT_KEYS
           if k in c and not (type(c[k]) is int and c[k] > 0)]
    for section in _SECTIONS:
        if section in c and not isinstance(c[section], dict):
            bad.append(f"{section} is a {type(c[section]).__name__}, not an object")
    for section, key in _ID_LISTS:
        ids = c.get(section, {}).get(key) if isinstance(c.get(section), dict) else None
        if ids is not None and not (isinstance(ids, list)
                                    and all(type(i) is int for i in ids)):
            bad.append(f"{section}.{key} is {ids!r}, not a list of layer ids")
    engine = c.get("draftsmith", {}).get("engine", DEFAULT) \
        if isinstance(c.get("draftsmith"), dict) else DEFAULT
    if engine not in ENGINES:
        bad.append(f"draftsmith.engine is {engine!r}, not one of {list(ENGINES)}")
    return bad


def _check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    if d2t.dtype != torch.int64:
        return [f"d2t has dtype {d2t.dtype}, engines expect int64"]
    if t2d.dtype != torch.bool:
        return [f"t2d has dtype {t2d.dtype}, engines expect bool"]
    target_ids = d2t + torch.arange(len(d2t))
    if target_ids.min() < 0 or target_ids.max() >= len(t2d) or \
            not bool(t2d[target_ids.clamp(0, len(t2d) - 1)].all()) or \
            len(set(target_ids.tolist())) != len(d2t):
        hint = ""
        if bool(t2d[d2t.clamp(0, len(t2d) - 1)].all()) and len(set(d2t.tolist())) == len(d2t):
            hint = " (it holds target ids; engines read OFFSETS: target_id = draft_id + d2t[draft_id])"
        return ["d2t does not map the draft vocab onto the tokens t2d marks" + hint]
    if int(t2d.sum()) != len(d2t):
        return [f"t2d marks {int(t2d.sum())} tokens but the draft vocab has {len(d2t)}"]
    return []


# ----------------------------------------------------------------------------- stage


def run(cfg, target_dir: Path, drafter_dir: Path, out_dir: Path) -> dict:
    """Export the trained drafter for both engines and validate each against the target."""
    from draftsmith.target_info import read_info

    info = read_info(target_dir)
    model = load_drafter(drafter_dir)
    export(model, out_dir, dtype=cfg.dtype, target_num_layers=info.num_layers, provenance={
        "target": {"model": info.model, "revision": info.revision, "kind": info.kind}})
    out = {}
    engines = [e.name for e in served_by(model.config)]
    for engine in ENGINES:  # None: an engine that does not serve this method
        out[f"{engine}_aux_layer_ids"] = validate(
            Path(out_dir) / engine, target_num_layers=info.num_layers,
            target_hidden_size=info.hidden_size, target_vocab_size=info.vocab_size,
        )["aux_layer_ids"] if engine in engines else None
    # Every engine's folder holds the same weights: the first one's size stands for them.
    out["bytes"] = (Path(out_dir) / engines[0] / "model.safetensors").stat().st_size
    out["dtype"] = cfg.dtype
    return out
