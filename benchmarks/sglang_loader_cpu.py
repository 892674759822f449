"""SGLang 0.5.17's own draft-model config and loading code, run on a CPU over one of our
EAGLE-3 exports (config.json + model.safetensors): where every tensor lands. SGLang serves
speculative decoding on CUDA only, but its loader runs anywhere; this is the check of the
SGLang export by the engine's code rather than by reading it.

    # SGLang's environment: Python 3.12, torch 2.11.0, SGLang unpacked by tools/gpu_wheelhouse.py
    python3.12 -m venv /tmp/py312 && /tmp/py312/bin/pip install torch==2.11.0
    python tools/gpu_wheelhouse.py sglang && cp .gpu-sglang/c*/* /tmp/sglang-chunks/ \
        && PATH=/tmp/py312/bin:$PATH bash /tmp/sglang-chunks/install.sh
    PYTHONPATH=/tmp/sglang-site /tmp/py312/bin/python benchmarks/sglang_loader_cpu.py \
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
import socket
import sys
import traceback
import types
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
        fn = f.filename.split("site/", 1)[-1]
        loc = f"{fn}:{f.lineno} ({f.name})"
    return f"{type(e).__name__}: {e} @ {loc}"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def check(draft: Path, target: Path, dtype: str = "auto") -> dict:
    import torch
    from safetensors.torch import load_file

    R: dict = {"draft": str(draft), "target": str(target), "server_dtype": dtype}
    ours = load_file(str(draft / "model.safetensors"))
    cfg = json.loads((draft / "config.json").read_text())
    R["our_tensors"] = {k: [list(v.shape), str(v.dtype)] for k, v in ours.items()}

    # ------------------------------------------------------------------ a) config
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    step = R.setdefault("a", {})
    try:
        sa = ServerArgs(model_path=str(target), device="cpu", speculative_algorithm="EAGLE3",
                        speculative_draft_model_path=str(draft), speculative_num_steps=3,
                        speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                        skip_tokenizer_init=True, disable_cuda_graph=True,
                        attention_backend="torch_native", dtype=dtype)
        set_global_server_args_for_scheduler(sa)
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader import get_model_architecture

        arch_in = cfg["architectures"][0]
        # exactly tp_worker._init_model_config for the draft worker
        mc = ModelConfig.from_server_args(sa, model_path=str(draft), is_draft_model=True)
        hf = mc.hf_config
        cls, arch = get_model_architecture(mc)
        step.update(ran=True, arch_in_config=arch_in, arch_after_ModelConfig=hf.architectures,
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
        # --dtype as the project's server.py passes it: target and draft get the same value
        import dataclasses
        by = {}
        for dt in ("auto", "float32", "bfloat16", "float16"):
            try:
                sa2 = dataclasses.replace(sa, dtype=dt) if dt != sa.dtype else sa
                by[dt] = [str(ModelConfig.from_server_args(sa2).dtype),
                          str(ModelConfig.from_server_args(sa2, model_path=str(draft),
                                                           is_draft_model=True).dtype)]
            except Exception as e:
                by[dt] = where(e)
        step["dtype_target_draft_by_server_dtype"] = by
    except Exception as e:
        step.update(ran=False, error=where(e), tb=traceback.format_exc()[-3000:])
        return R

    # target side: which ids the target captures (model_runner -> set_eagle3_layers_to_capture)
    tstep = R.setdefault("a_target_side", {})
    try:
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
    except Exception as e:
        tstep.update(ran=False, error=where(e), tb=traceback.format_exc()[-3000:])
        tmc = None

    # ------------------------------------------------------------------ b) construct
    step = R.setdefault("b", {})
    try:
        from sglang.srt.distributed.bootstrap import _init_parallel_groups

        _init_parallel_groups(backend="gloo", dist_init_method=f"tcp://127.0.0.1:{free_port()}",
                              server_args=sa, model_config=tmc or mc, gpu_id=0, tp_rank=0,
                              tp_size=1, pp_rank=0, pp_size=1, attn_dp_size=1, attn_cp_size=1,
                              moe_ep_size=1, moe_dp_size=1, dcp_size=1)
        step["parallel_init"] = "ok (bootstrap._init_parallel_groups, gloo, world 1)"
    except Exception as e:
        step.update(ran=False, error="parallel init: " + where(e), tb=traceback.format_exc()[-3000:])
        return R

    try:
        from sglang.srt.configs.device_config import DeviceConfig
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
    except Exception as e:
        step.update(ran=False, error=where(e), tb=traceback.format_exc()[-3000:])
        return R

    # ------------------------------------------------------------------ c) load + compare
    step = R.setdefault("c", {})
    try:
        with torch.no_grad():
            for p in params.values():
                if p.is_floating_point():
                    p.fill_(float("nan"))
        import logging
        logs = []

        class H(logging.Handler):
            def emit(self, rec):
                if rec.levelno >= logging.WARNING:
                    logs.append(f"{rec.name}: {rec.getMessage()}")
        logging.getLogger().addHandler(H())
        with set_default_torch_dtype(mc.dtype):
            loader.load_weights_and_postprocess(model, loader._get_all_weights(mc, model),
                                                torch.device("cpu"))
        step["ran"] = True
        step["sglang_warnings"] = logs
    except Exception as e:
        step.update(ran=False, error=where(e), tb=traceback.format_exc()[-3000:])
        return R

    mla = type(model).__name__ == "Eagle3DeepseekV2ForCausalLM"
    hf = mc.hf_config
    H = hf.hidden_size
    # where each of our tensors must land: param name -> [(our name, row offset)]
    expect: dict = {}

    def put(param, name, off=0):
        expect.setdefault(param, []).append((name, off))

    for name, t in ours.items():
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
    d2t = ours.get("d2t")
    hot = getattr(model, "hot_token_id", None)
    if d2t is None:
        step["hot_token_id"] = "no d2t in export"
    elif hot is None:
        step["hot_token_id"] = "MODEL HAS NO hot_token_id after load"
    else:
        want = d2t + torch.arange(len(d2t))
        t2d = ours.get("t2d")
        step["hot_token_id"] = {
            "dtype": str(hot.dtype), "len": len(hot), "equals_d2t_plus_arange": bool(torch.equal(hot, want)),
            "all_marked_in_t2d": bool(t2d[hot].all()) if t2d is not None else None,
            "unique": len(set(hot.tolist())) == len(hot),
            "range": [int(hot.min()), int(hot.max())], "lm_head_rows": params["lm_head.weight"].shape[0]}

    # ------------------------------------------------------------------ d) MLA post_load_weights
    if mla:
        step = R.setdefault("d", {})
        try:
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
        except Exception as e:
            step.update(ran=False, error=where(e), tb=traceback.format_exc()[-3000:])

    # ------------------------------------------------------------------ rope (extra)
    step = R.setdefault("rope", {})
    try:  # the draft layer's rotary: the drafter trained with plain rope at rope_theta
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
    except Exception as e:
        step.update(ran=False, error=where(e))

    # ------------------------------------------------------------------ e2e + set_embed
    step = R.setdefault("e2e_load_model", {})
    try:
        m2 = loader.load_model(model_config=mc, device_config=DeviceConfig("cpu", 0))
        p2 = dict(m2.named_parameters())
        same = all(torch.equal(p2[k], params[k]) for k in params if k in p2 and k not in nan_left)
        step.update(ran=True, model_class=type(m2).__name__, same_params_as_instrumented=same)
    except Exception as e:
        step.update(ran=False, error=where(e), tb=traceback.format_exc()[-3000:])
    step = R.setdefault("set_embed", {})
    try:  # eagle_worker_v2.init_lm_head's call with a target-shaped embedding
        emb = torch.nn.Parameter(torch.randn(hf.vocab_size, tmc.hf_config.hidden_size if tmc else H,
                                             dtype=mc.dtype), requires_grad=False)
        model.set_embed(emb)
        step.update(ran=True, embed_is_target=model.model.embed_tokens.weight is emb)
    except Exception as e:
        step.update(ran=False, error=where(e),
                    embed_replaced_before_error=model.model.embed_tokens.weight is emb)
    if tmc is not None and "a_target_side" in R and R["a_target_side"].get("ran"):
        try:  # the target model's capture layers (class built on cpu, no weights; built last: get_rope caches rotary modules by shape, so a meta-device target would hand the draft a meta cos_sin_cache)
            from sglang.srt.model_loader.loader import _initialize_model
            from sglang.srt.configs.load_config import LoadConfig
            from sglang.srt.model_loader.utils import set_default_torch_dtype

            with set_default_torch_dtype(tmc.dtype), torch.device("cpu"):
                tm = _initialize_model(tmc, LoadConfig(), None)
            tm.set_eagle3_layers_to_capture(R["a_target_side"]["eagle_aux_hidden_state_layer_ids"])
            R["a_target_side"]["target_layers_to_capture"] = list(tm.model.layers_to_capture)
            R["a_target_side"]["target_class"] = type(tm).__name__
            del tm
        except Exception as e:
            R["a_target_side"]["target_class_error"] = where(e)

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
