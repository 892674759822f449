"""SGLang 0.5.17's own draft-model config and loading code, run on a CPU over one of our
EAGLE-3 exports (config.json + model.safetensors): where every tensor lands. SGLang serves
speculative decoding on CUDA only, but its loader runs anywhere; this is the check of the
SGLang export by the engine's code rather than by reading it.

    # SGLang's environment: Python 3.12, torch 2.11.0 (the GPU image's), SGLang 0.5.17 from PyPI
    # (241 s on a 2-core machine, 2026-12-06; or unpacked by tools/gpu_wheelhouse.py into
    # /tmp/sglang-site, then PYTHONPATH=/tmp/sglang-site)
    PYENV_VERSION=3.12.1 python3.12 -m venv /tmp/py312
    /tmp/py312/bin/pip install torch==2.11.0 sglang==0.5.17
    /tmp/py312/bin/python benchmarks/sglang_loader_cpu.py \
        --draft models/export/sglang --target models/target/model --json out.json

One export per process (SGLang's parallel state is process-global). Each step reports ran /
result / the error with the SGLang file:line that raised:
  a) ServerArgs(device=cpu, EAGLE3, the draft) -> ModelConfig.from_server_args(is_draft_model
     =True) as managers/tp_worker.py builds the draft's: the architecture it resolves to,
     draft_vocab_size and the rest; the dtype target and draft get for each --dtype; on the
     target side, the aux ids model_runner passes to set_eagle3_layers_to_capture and the
     layers the target class then captures.
  b) parallel state as distributed/bootstrap.py::_init_parallel_groups (gloo, world 1), then
     the draft class built as DefaultModelLoader.load_model builds it.
  c) every parameter NaN-filled, then SGLang's own safetensors iterator into model.load_weights;
     each of our tensors compared with where it must land (stacked qkv / gate_up, MLA's fused
     q_a + kv_a); NaN left = not loaded; hot_token_id against d2t + arange. Also SGLang's
     unmodified load_model.
  d) MLA: post_load_weights' w_kc / w_vc against our kv_b_proj split.
  extra: the draft layer's rotary table against plain rope at rope_theta; set_embed.
"""
import argparse
import json
import os
import re
import socket
import sys
import traceback
import types
from contextlib import contextmanager
from pathlib import Path

# SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) needs sgl-kernel's CPU build, which the CUDA
# wheel is not (ServerArgs already fails: sgl_kernel/load_utils.py:197). Without it, on a
# machine with no GPU, RotaryEmbedding.__init__ (layers/rotary_embedding/base.py:119) imports
# vllm._custom_ops.rotary_embedding as its fallback forward kernel. Nothing here runs a forward:
# a stand-in module that raises if called.
_vllm, _ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")


def _no_kernel(*a, **k):
    raise RuntimeError("vllm._custom_ops.rotary_embedding stand-in called: no forward here")


_ops.rotary_embedding = _no_kernel
_vllm._custom_ops = _ops
sys.modules.setdefault("vllm", _vllm)
sys.modules.setdefault("vllm._custom_ops", _ops)


def where(e: BaseException) -> str:
    """The innermost frame inside sglang (file:line) that raised, plus the exception."""
    tb = traceback.extract_tb(e.__traceback__)
    sg = [f for f in tb if "/sglang/" in f.filename]
    f = (sg or tb)[-1] if (sg or tb) else None
    loc = ""
    if f is not None:
        fn = re.split(r"site(?:-packages)?/", f.filename, maxsplit=1)[-1]  # from sglang/ on
        loc = f"{fn}:{f.lineno} ({f.name})"
    return f"{type(e).__name__}: {e} @ {loc}"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@contextmanager
def recorded(R: dict, name: str, tb: bool = True):
    """R[name], filled by the block; an exception in the block is recorded there (ran=False,
    the SGLang file:line that raised, the traceback's tail) instead of raised, and the code
    after the block runs (a step that returns its result from inside the block returns None
    after it on failure)."""
    step = R.setdefault(name, {})
    try:
        yield step
    except Exception as e:
        step.update(ran=False, error=where(e))
        if tb:
            step["tb"] = traceback.format_exc()[-3000:]


def server_config(R: dict, draft: Path, target: Path, dtype: str, cfg: dict):
    """a) ServerArgs and the draft's ModelConfig as tp_worker._init_model_config builds them:
    -> (server args, model config), or None where SGLang refused (recorded in R["a"])."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    with recorded(R, "a") as step:
        sa = ServerArgs(model_path=str(target), device="cpu", speculative_algorithm="EAGLE3",
                        speculative_draft_model_path=str(draft), speculative_num_steps=3,
                        speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                        skip_tokenizer_init=True, disable_cuda_graph=True,
                        attention_backend="torch_native", dtype=dtype)
        set_global_server_args_for_scheduler(sa)
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader import get_model_architecture

        mc = ModelConfig.from_server_args(sa, model_path=str(draft), is_draft_model=True)
        hf = mc.hf_config
        cls, arch = get_model_architecture(mc)
        step.update(ran=True, arch_in_config=cfg["architectures"][0],
                    arch_after_ModelConfig=hf.architectures,
                    resolved_class=f"{cls.__module__}.{cls.__name__}", hf_config_class=type(hf).__name__,
                    model_type=hf.model_type, dtype=str(mc.dtype),
                    draft_vocab_size=getattr(hf, "draft_vocab_size", "MISSING"),
                    vocab_size=hf.vocab_size, mc_vocab_size=mc.vocab_size,
                    hidden_size=hf.hidden_size, target_hidden_size=getattr(hf, "target_hidden_size", None),
                    num_hidden_layers=hf.num_hidden_layers, mc_num_attention_layers=mc.num_attention_layers,
                    num_nextn_predict_layers=mc.num_nextn_predict_layers,
                    eagle_config=getattr(hf, "eagle_config", None),
                    fc_norm=getattr(hf, "fc_norm", None), norm_output=getattr(hf, "norm_output", None),
                    attention_arch=str(mc.attention_arch), head_dim=mc.head_dim,
                    context_len=mc.context_len,
                    rope=getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None),
                    tie_word_embeddings=hf.tie_word_embeddings)
        for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "num_key_value_heads", "rope_theta"):
            if hasattr(hf, k):
                step[k] = getattr(hf, k)
        if hasattr(mc, "kv_lora_rank"):
            step["mc_kv_lora_rank"] = mc.kv_lora_rank
            step["mc_qk_rope_head_dim"] = getattr(mc, "qk_rope_head_dim", None)
            step["mc_scaling"] = getattr(mc, "scaling", None)
        step["dtype_target_draft_by_server_dtype"] = dtypes_by_server_dtype(sa, draft)
        return sa, mc
    return None


def dtypes_by_server_dtype(sa, draft: Path) -> dict:
    """--dtype as the project's server.py passes it (target and draft get the same value):
    the dtype each then gets, for each value."""
    import dataclasses

    from sglang.srt.configs.model_config import ModelConfig

    by = {}
    for dt in ("auto", "float32", "bfloat16", "float16"):
        try:
            sa2 = dataclasses.replace(sa, dtype=dt) if dt != sa.dtype else sa
            by[dt] = [str(ModelConfig.from_server_args(sa2).dtype),
                      str(ModelConfig.from_server_args(sa2, model_path=str(draft),
                                                       is_draft_model=True).dtype)]
        except Exception as e:
            by[dt] = where(e)
    return by


def target_side(R: dict, sa):
    """Which ids the target captures (model_runner -> set_eagle3_layers_to_capture): -> the
    target's ModelConfig, or None."""
    with recorded(R, "a_target_side") as tstep:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
            resolve_spec_aux_hidden_state_config)
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        tmc = ModelConfig.from_server_args(sa)
        aux = resolve_spec_aux_hidden_state_config(
            server_args=sa, model_config=tmc, spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
            is_draft_worker=False)
        tstep.update(ran=True, target_arch=tmc.hf_config.architectures,
                     target_num_layers=tmc.hf_config.num_hidden_layers,
                     target_hidden=tmc.hf_config.hidden_size, target_vocab=tmc.vocab_size, target_dtype=str(tmc.dtype),
                     eagle_use_aux_hidden_state=aux.eagle_use_aux_hidden_state,
                     eagle_draft_num_layers=aux.eagle_draft_num_layers,
                     eagle_aux_hidden_state_layer_ids=aux.eagle_aux_hidden_state_layer_ids)
        return tmc
    return None


def build_draft(R: dict, sa, mc, tmc):
    """b) parallel state as distributed/bootstrap.py::_init_parallel_groups (gloo, world 1),
    then the draft class as DefaultModelLoader.load_model builds it: -> (loader, model, its
    parameters, the model config it was built with), or None (recorded in R["b"])."""
    import torch

    with recorded(R, "b") as step:
        try:
            from sglang.srt.distributed.bootstrap import _init_parallel_groups

            _init_parallel_groups(backend="gloo", dist_init_method=f"tcp://127.0.0.1:{free_port()}",
                                  server_args=sa, model_config=tmc or mc, gpu_id=0, tp_rank=0,
                                  tp_size=1, pp_rank=0, pp_size=1, attn_dp_size=1, attn_cp_size=1,
                                  moe_ep_size=1, moe_dp_size=1, dcp_size=1)
        except Exception as e:
            step.update(ran=False, error="parallel init: " + where(e),
                        tb=traceback.format_exc()[-3000:])
            return None
        step["parallel_init"] = "ok (bootstrap._init_parallel_groups, gloo, world 1)"
        from sglang.srt.model_executor.model_runner_components.load_model_utils import (
            build_load_config)
        from sglang.srt.model_loader import get_model_loader
        from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
        from sglang.srt.model_loader.utils import set_default_torch_dtype

        load_config = build_load_config(server_args=sa, tp_rank=0,
                                        remote_instance_weight_transporter_engine=None,
                                        remote_instance_weight_transporter_session_id="",
                                        draft_model_idx=None, weight_cache_mode="off",
                                        weight_cache_socket=None)
        try:  # model_runner.load_model's CPU-only config step
            from sglang.srt.model_executor.model_runner_components.load_model_utils import (
                adjust_config_with_unaligned_cpu_tp)
            mc = adjust_config_with_unaligned_cpu_tp(mc, load_config, 1)
        except ImportError:
            pass
        loader = get_model_loader(load_config, mc)
        quant_config = _get_quantization_config(mc, load_config)
        with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
            model = _initialize_model(mc, load_config, quant_config)
        params = dict(model.named_parameters())
        step.update(ran=True, loader=type(loader).__name__, quant_config=repr(quant_config),
                    model_class=type(model).__name__,
                    params={k: [list(p.shape), str(p.dtype)] for k, p in params.items()},
                    load_lm_head_from_target=getattr(model, "load_lm_head_from_target", None))
        return loader, model, params, mc
    return None


def load_nan_filled(R: dict, loader, model, params: dict, mc) -> dict | None:
    """c) every parameter NaN-filled, then SGLang's own safetensors iterator into
    model.load_weights: -> R["c"], or None where loading raised."""
    import logging

    import torch
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with recorded(R, "c") as step:
        with torch.no_grad():
            for p in params.values():
                if p.is_floating_point():
                    p.fill_(float("nan"))
        logs = []

        class Warnings(logging.Handler):
            def emit(self, rec):
                if rec.levelno >= logging.WARNING:
                    logs.append(f"{rec.name}: {rec.getMessage()}")
        logging.getLogger().addHandler(Warnings())
        with set_default_torch_dtype(mc.dtype):
            loader.load_weights_and_postprocess(model, loader._get_all_weights(mc, model),
                                                torch.device("cpu"))
        step["ran"] = True
        step["sglang_warnings"] = logs
        return step
    return None


def expected_landing(ours: dict, hf, mla: bool) -> dict:
    """SGLang parameter -> [(our tensor, row offset)]: where each of our tensors must land
    (stacked qkv / gate_up, MLA's fused q_a + kv_a)."""
    H = hf.hidden_size
    expect: dict = {}

    def put(param, name, off=0):
        expect.setdefault(param, []).append((name, off))

    for name in ours:
        if name in ("d2t", "t2d"):
            continue
        n = name
        layer = "model.midlayer." if mla else "model.layers.0."
        if n.startswith("midlayer."):
            n = layer + n[len("midlayer."):]
        elif not n.startswith("lm_head."):
            n = "model." + n
        if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) and not mla:
            nh, nkv, hd = hf.num_attention_heads, hf.num_key_value_heads, getattr(hf, "head_dim", H // hf.num_attention_heads)
            off = {"q": 0, "k": nh * hd, "v": (nh + nkv) * hd}[n.split(".")[-2][0]]
            put(n.rsplit(".", 2)[0] + ".qkv_proj.weight", name, off)
        elif n.endswith(("gate_proj.weight", "up_proj.weight")):
            off = 0 if "gate_proj" in n else hf.intermediate_size
            put(n.rsplit(".", 2)[0] + ".gate_up_proj.weight", name, off)
        elif mla and n.endswith("q_a_proj.weight"):
            put(n.replace("q_a_proj", "fused_qkv_a_proj_with_mqa"), name, 0)
        elif mla and n.endswith("kv_a_proj_with_mqa.weight"):
            put(n.replace("kv_a_proj_with_mqa", "fused_qkv_a_proj_with_mqa"), name, hf.q_lora_rank)
        else:
            put(n, name, 0)
    return expect


def compare_landing(step: dict, ours: dict, params: dict, expect: dict) -> dict:
    """Each of our tensors against the rows it must land in; what was left NaN (not loaded),
    into step: -> the parameters left unloaded."""
    import torch

    cmp, bad_shape, mismatched, skipped = {}, [], [], []
    for param, srcs in expect.items():
        if param not in params:
            skipped += [s for s, _ in srcs]
            continue
        p = params[param].detach()
        for src, off in srcs:
            t = ours[src]
            if t.shape[1:] != p.shape[1:] or off + t.shape[0] > p.shape[0]:
                bad_shape.append(f"{src} {tuple(t.shape)} -> {param} {tuple(p.shape)} @ {off}")
                continue
            got = p[off: off + t.shape[0]]
            ok = torch.equal(got, t.to(p.dtype))
            cmp[src] = f"{param}[{off}:{off + t.shape[0]}] " + ("equal" if ok else "DIFFERENT")
            if not ok:
                mismatched.append(src)
    nan_left = {k: f"{int(torch.isnan(p).sum())}/{p.numel()} NaN" for k, p in params.items()
                if p.is_floating_point() and torch.isnan(p).any()}
    step.update(landed=cmp, skipped_ours=skipped, shape_mismatch=bad_shape,
                value_mismatch=mismatched, params_not_loaded=nan_left,
                params_not_loaded_expected=["model.embed_tokens.weight (shared from target by "
                                            "eagle_worker_v2.init_lm_head -> set_embed)"])
    return nan_left


def hot_tokens(ours: dict, model, params: dict):
    """hot_token_id after the load against d2t + arange."""
    import torch

    d2t = ours.get("d2t")
    hot = getattr(model, "hot_token_id", None)
    if d2t is None:
        return "no d2t in export"
    if hot is None:
        return "MODEL HAS NO hot_token_id after load"
    want = d2t + torch.arange(len(d2t))
    t2d = ours.get("t2d")
    return {"dtype": str(hot.dtype), "len": len(hot), "equals_d2t_plus_arange": bool(torch.equal(hot, want)),
            "all_marked_in_t2d": bool(t2d[hot].all()) if t2d is not None else None,
            "unique": len(set(hot.tolist())) == len(hot),
            "range": [int(hot.min()), int(hot.max())], "lm_head_rows": params["lm_head.weight"].shape[0]}


def mla_split(R: dict, model, ours: dict, mc) -> None:
    """d) MLA: post_load_weights' w_kc / w_vc against our kv_b_proj split."""
    import torch

    hf = mc.hf_config
    with recorded(R, "d") as step:
        a = model.model.midlayer.self_attn
        kvb = ours["midlayer.self_attn.kv_b_proj.weight"].to(mc.dtype)
        nope, vd = hf.qk_nope_head_dim, hf.v_head_dim
        w = kvb.unflatten(0, (-1, nope + vd))
        want_kc, want_vc = w[:, :nope], w[:, nope:].transpose(1, 2)
        step.update(ran=getattr(a, "w_kc", None) is not None,
                    w_kc=[list(a.w_kc.shape), bool(torch.equal(a.w_kc, want_kc))] if a.w_kc is not None else None,
                    w_vc=[list(a.w_vc.shape), bool(torch.equal(a.w_vc, want_vc))] if a.w_vc is not None else None,
                    w_kc_expected_shape=[hf.num_attention_heads, nope, hf.kv_lora_rank],
                    w_vc_expected_shape=[hf.num_attention_heads, hf.kv_lora_rank, vd],
                    attn_flags={k: getattr(a, k, None) for k in (
                        "has_fused_proj", "q_lora_rank", "kv_lora_rank", "num_local_heads",
                        "scaling", "use_deep_gemm_bmm", "w_scale")})


def rope(R: dict, model, cfg: dict, mla: bool) -> None:
    """The draft layer's rotary table against plain rope at rope_theta (the drafter trained
    with it)."""
    import torch

    with recorded(R, "rope", tb=False) as step:
        a = model.model.midlayer.self_attn if mla else model.model.layers[0].self_attn
        re_ = a.rotary_emb
        rd = re_.rotary_dim
        theta = float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta"))
        n = min(re_.cos_sin_cache.shape[0], 512)
        inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
        want = torch.cat([ang.cos(), ang.sin()], -1)
        got = re_.cos_sin_cache[:n].double()
        step.update(ran=True, cls=type(re_).__name__, is_neox_style=re_.is_neox_style,
                    rotary_dim=rd, head_size=re_.head_size, base=float(re_.base),
                    cache_dtype=str(re_.cos_sin_cache.dtype),
                    max_abs_diff_vs_plain_rope=float((got - want).abs().max()),
                    max_abs_diff_vs_plain_rope_in_cache_dtype=float(
                        (got - want.to(re_.cos_sin_cache.dtype).double()).abs().max()),
                    attn_scaling=float(a.scaling),
                    our_layout="pairwise (is_neox_style=False)" if mla else "rotate-half (neox)")


def unmodified_load(R: dict, loader, mc, params: dict, nan_left: dict) -> None:
    """SGLang's own load_model, untouched: the same parameters as the instrumented load."""
    import torch

    with recorded(R, "e2e_load_model") as step:
        from sglang.srt.configs.device_config import DeviceConfig

        m2 = loader.load_model(model_config=mc, device_config=DeviceConfig("cpu", 0))
        p2 = dict(m2.named_parameters())
        same = all(torch.equal(p2[k], params[k]) for k in params if k in p2 and k not in nan_left)
        step.update(ran=True, model_class=type(m2).__name__, same_params_as_instrumented=same)


def set_embed(R: dict, model, mc, tmc) -> None:
    """eagle_worker_v2.init_lm_head's call with a target-shaped embedding."""
    import torch

    hf = mc.hf_config
    step = R.setdefault("set_embed", {})
    emb = None
    try:
        emb = torch.nn.Parameter(torch.randn(hf.vocab_size, tmc.hf_config.hidden_size if tmc else hf.hidden_size,
                                             dtype=mc.dtype), requires_grad=False)
        model.set_embed(emb)
        step.update(ran=True, embed_is_target=model.model.embed_tokens.weight is emb)
    except Exception as e:
        step.update(ran=False, error=where(e),
                    embed_replaced_before_error=model.model.embed_tokens.weight is emb)


def target_capture(R: dict, tmc) -> None:
    """The target class's capture layers for the ids of a_target_side (built on the CPU, no
    weights; built last: get_rope caches rotary modules by shape, so a meta-device target
    would hand the draft a meta cos_sin_cache)."""
    import torch

    side = R.get("a_target_side", {})
    if tmc is None or not side.get("ran"):
        return
    try:
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import _initialize_model
        from sglang.srt.model_loader.utils import set_default_torch_dtype

        with set_default_torch_dtype(tmc.dtype), torch.device("cpu"):
            tm = _initialize_model(tmc, LoadConfig(), None)
        tm.set_eagle3_layers_to_capture(side["eagle_aux_hidden_state_layer_ids"])
        side["target_layers_to_capture"] = list(tm.model.layers_to_capture)
        side["target_class"] = type(tm).__name__
        del tm
    except Exception as e:
        side["target_class_error"] = where(e)


def check(draft: Path, target: Path, dtype: str = "auto") -> dict:
    """Every step on one export, in order; a step later ones need stops the run where it
    failed (the report says where)."""
    from safetensors.torch import load_file

    R: dict = {"draft": str(draft), "target": str(target), "server_dtype": dtype}
    ours = load_file(str(draft / "model.safetensors"))
    cfg = json.loads((draft / "config.json").read_text())
    R["our_tensors"] = {k: [list(v.shape), str(v.dtype)] for k, v in ours.items()}
    configured = server_config(R, draft, target, dtype, cfg)
    if configured is None:
        return R
    sa, mc = configured
    tmc = target_side(R, sa)
    built = build_draft(R, sa, mc, tmc)
    if built is None:
        return R
    loader, model, params, mc = built
    step = load_nan_filled(R, loader, model, params, mc)
    if step is None:
        return R
    mla = type(model).__name__ == "Eagle3DeepseekV2ForCausalLM"
    nan_left = compare_landing(step, ours, params, expected_landing(ours, mc.hf_config, mla))
    step["hot_token_id"] = hot_tokens(ours, model, params)
    if mla:
        mla_split(R, model, ours, mc)
    rope(R, model, cfg, mla)
    unmodified_load(R, loader, mc, params, nan_left)
    set_embed(R, model, mc, tmc)
    target_capture(R, tmc)
    return R


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="an SGLang export (models/export/sglang)")
    ap.add_argument("--target", required=True, help="the target's HF folder")
    ap.add_argument("--json", help="write the report here too")
    ap.add_argument("--dtype", default="auto",
                    help="ServerArgs.dtype (the pipeline's server.py always passes one)")
    a = ap.parse_args()
    s = json.dumps(check(Path(a.draft), Path(a.target), a.dtype), indent=1, default=str)
    if a.json:
        Path(a.json).write_text(s)
    print(s)
    os._exit(0)  # skip gloo's teardown


if __name__ == "__main__":
    main()
