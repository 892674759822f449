"""Export the drafter for the engines and validate an export.

One folder per engine of serving/engines.py, each the `LlamaForCausalLMEagle3` layout that
vLLM loads (llama_eagle3.py) and SGLang reads: config.json + model.safetensors with
`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` (offsets) and `t2d`; the embedding table is left
out (the engines share the target's). The weights are the same in every folder; the aux layer
ids are written in each engine's convention (its table entry):

- `vllm/`: id k = the hidden state entering target layer k (ours), in the top-level
  `eagle_aux_hidden_state_layer_ids` (what vLLM reads) and in `eagle_config`;
- `sglang/`: SGLang reads an id i as the OUTPUT of layer i, so id k there means the same tensor
  as vLLM's k + 1, in `eagle_config` only. Since sglang#25454 some models add the one only when
  the first id is 1, so the SGLang form is only written unambiguous: first vLLM id 2 (the
  default), first SGLang id 1, read the same by old and new SGLang.

Each config states its convention in `draftsmith.aux_layer_convention`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.checkpoint import drafter_state, load_drafter
from draftsmith.atomic import atomic_path, write_json
from draftsmith.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.errors import DraftsmithError
from draftsmith.serving.engines import DEFAULT, ENGINES, Engine

# The drafter layer's kind -> the architecture engines load it as. MLA: vLLM's
# deepseek_eagle3.py and SGLang's kimi_k25_eagle3.py both register the V2 name (only some
# SGLang versions the V3 alias).
ARCHS = {"llama": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}
OURS = ENGINES["vllm"]  # training's aux layer ids are in vLLM's convention


def _attention_config(c: DrafterConfig) -> dict:
    if c.arch == "llama":
        return {"model_type": "llama", "num_key_value_heads": c.num_kv_heads,
                "head_dim": c.head_dim, "rope_theta": c.rope_theta}
    # DeepSeek-V2's config (V2 and V3 share the MLA layer; vLLM turns a deepseek_v3 draft into
    # its MTP model), pairwise (non-NeoX) rope, softmax scale qk^-0.5 without YaRN
    return {"model_type": "deepseek_v2", "num_key_value_heads": c.num_heads,
            "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank,
            "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
            "v_head_dim": c.v_head_dim, "head_dim": c.qk_rope_head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}}


def _config(c: DrafterConfig, engine: Engine, dtype: str, provenance: dict) -> dict:
    return {
        "architectures": [ARCHS[c.arch]],
        **_attention_config(c),
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        **({"eagle_aux_hidden_state_layer_ids": engine.layer_ids(c.aux_layers)}
           if engine.top_level_aux_ids else {}),
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": engine.layer_ids(c.aux_layers),
            "norm_before_fc": False,
        },
        "draftsmith": {
            "engine": engine.name,
            "aux_layer_convention": engine.aux_convention,
            "aux_layers_vllm_convention": list(c.aux_layers),
            "aux_capture": "the residual stream entering each layer, before any norm "
                           "(norm_before_fc: false)",
            **provenance,
        },
    }


def export(model: Eagle3Drafter, out_dir: Path, *, dtype: str = "bfloat16",
           provenance: dict | None = None) -> None:
    """Write out_dir/<engine> for each engine (out_dir/vllm, out_dir/sglang)."""
    tensors = drafter_state(model, getattr(torch, dtype))
    with atomic_path(out_dir) as tmp:
        for engine in ENGINES.values():
            d = tmp / engine.name
            d.mkdir(parents=True)
            save_file(tensors, d / "model.safetensors")
            write_json(d / "config.json", _config(model.config, engine, dtype, provenance or {}))


# ----------------------------------------------------------------------------- validate


def _attention_shapes(c: dict) -> dict[str, tuple]:
    H, nh = c["hidden_size"], c["num_attention_heads"]
    a = "midlayer.self_attn."
    if c.get("architectures") != [ARCHS["mla"]]:
        nkv, hd = c["num_key_value_heads"], c["head_dim"]
        return {a + "q_proj.weight": (nh * hd, 2 * H), a + "k_proj.weight": (nkv * hd, 2 * H),
                a + "v_proj.weight": (nkv * hd, 2 * H), a + "o_proj.weight": (H, nh * hd)}
    q_lora, kv_lora = c.get("q_lora_rank"), c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q = {a + "q_a_proj.weight": (q_lora, 2 * H), a + "q_a_layernorm.weight": (q_lora,),
         a + "q_b_proj.weight": (nh * (nope + rope), q_lora)} if q_lora else \
        {a + "q_proj.weight": (nh * (nope + rope), 2 * H)}
    return {**q, a + "kv_a_proj_with_mqa.weight": (kv_lora + rope, 2 * H),
            a + "kv_a_layernorm.weight": (kv_lora,),
            a + "kv_b_proj.weight": (nh * (nope + v), kv_lora), a + "o_proj.weight": (H, nh * v)}


def _expected_shapes(c: dict) -> dict[str, tuple]:
    H = c["hidden_size"]
    I, Vd, V, Ht = c["intermediate_size"], c["draft_vocab_size"], c["vocab_size"], c["target_hidden_size"]
    n_aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    m = "midlayer."
    return {
        **_attention_shapes(c),
        m + "mlp.gate_proj.weight": (I, H),
        m + "mlp.up_proj.weight": (I, H),
        m + "mlp.down_proj.weight": (H, I),
        m + "input_layernorm.weight": (H,),
        m + "hidden_norm.weight": (H,),
        m + "post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "fc.weight": (H, n_aux * Ht),
        "lm_head.weight": (Vd, H),
        "d2t": (Vd,),
        "t2d": (V,),
    }


def validate(export_dir: Path, *, target_num_layers: int, target_hidden_size: int,
             target_vocab_size: int) -> dict:
    """Check an engine export against the target. Raises DraftsmithError listing every
    problem; returns a summary when it passes."""
    export_dir = Path(export_dir)
    problems: list[str] = []
    cfg_file, w_file = export_dir / "config.json", export_dir / "model.safetensors"
    for f in (cfg_file, w_file):
        if not f.exists():
            raise DraftsmithError(f"{export_dir}: {f.name} is missing", "re-run the train stage")
    c = json.loads(cfg_file.read_text())
    t = load_file(w_file)
    engine = ENGINES[c.get("draftsmith", {}).get("engine", DEFAULT)]

    if c.get("architectures") not in [[a] for a in ARCHS.values()]:
        problems.append(f"architectures is {c.get('architectures')}, engines load one of "
                        f"{[[a] for a in ARCHS.values()]}")
    elif c["architectures"] == [ARCHS["mla"]] and engine.name == "sglang" \
            and not c.get("q_lora_rank"):
        problems.append("an MLA drafter without q_lora_rank: vLLM loads it, SGLang's "
                        "Kimi-K2.5 EAGLE-3 model requires the low-rank query")
    for key, want in (("vocab_size", target_vocab_size), ("target_hidden_size", target_hidden_size),
                      ("hidden_size", target_hidden_size)):
        if c.get(key) != want:
            problems.append(f"config {key}={c.get(key)} but the target has {want}")
    ids = c.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        problems.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing (the engine "
                        "would fall back to its default layers, not the ones trained on)")
    else:
        if engine.top_level_aux_ids and c.get("eagle_aux_hidden_state_layer_ids") != ids:
            problems.append(f"top-level eagle_aux_hidden_state_layer_ids (what {engine.label} "
                            f"reads) is {c.get('eagle_aux_hidden_state_layer_ids')}, "
                            f"eagle_config says {ids}")
        if engine.first_aux_id is not None and ids[0] != engine.first_aux_id:
            problems.append(f"{engine.label} aux ids {ids} start at {ids[0]}: "
                            f"{engine.first_aux_id_why}; train with {OURS.label} aux layers "
                            f"starting at {engine.first_aux_id + engine.aux_id_offset}")
        trained = c.get("draftsmith", {}).get("aux_layers_vllm_convention")
        lo = -engine.aux_id_offset
        if any(not lo <= k < target_num_layers - engine.aux_id_offset for k in ids):
            problems.append(f"aux layer ids {ids} out of range for a {target_num_layers}-layer target")
        if trained is not None and ids != engine.layer_ids(trained):
            problems.append(
                f"aux layer ids {ids} do not match the layers trained on "
                f"({engine.layer_ids(trained)} in {engine.name}'s convention: "
                f"{engine.aux_convention})")

    norm_before_fc = c.get("eagle_config", {}).get("norm_before_fc", c.get("norm_before_fc"))
    if norm_before_fc and "input_norm.weight" not in t:
        problems.append(
            "norm_before_fc is true but there is no input_norm.weight: the engine would "
            "RMS-normalize the captured states (a unit-weight norm) before fc, while this drafter "
            "was trained on them un-normalized (captured before the norm: "
            f"{OURS.aux_convention}); set norm_before_fc: false")
    if "eagle_config" in c:
        for name, shape in _expected_shapes(c).items():
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
        raise DraftsmithError(f"{export_dir} is not a valid EAGLE-3 export:\n  - "
                              + "\n  - ".join(problems),
                              "re-export with `dvc repro train`, or fix the listed keys")
    return {"engine": engine.name, "aux_layer_ids": ids, "tensors": len(t),
            "dtype": str(next(iter(floats)))}


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
    export(model, out_dir, dtype=cfg.dtype, provenance={
        "target": {"model": info.model, "revision": info.revision, "kind": info.kind}})
    out = {}
    for engine in ENGINES:
        summary = validate(Path(out_dir) / engine, target_num_layers=info.num_layers,
                           target_hidden_size=info.hidden_size, target_vocab_size=info.vocab_size)
        out[f"{engine}_aux_layer_ids"] = summary["aux_layer_ids"]
    # Every engine's folder holds the same weights: the first one's size stands for them.
    out["bytes"] = (Path(out_dir) / next(iter(ENGINES)) / "model.safetensors").stat().st_size
    out["dtype"] = cfg.dtype
    return out
