"""Hidden states are exactly what the engines feed the drafter: the residual stream entering
layer k (vLLM: `hidden_states + residual` before layer k), before any final norm, on four
architectures; and the stage's files hold exactly those tensors."""

import pytest
import torch
from transformers import (DeepseekV3Config, LlamaConfig, Qwen3Config, Qwen3MoeConfig,
                          AutoModelForCausalLM)

from draftsmith import hidden
from draftsmith.config import HiddenConfig

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
              max_position_embeddings=128)
CONFIGS = {
    "llama": LlamaConfig(**COMMON, num_key_value_heads=2, intermediate_size=128),
    "qwen3": Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16, intermediate_size=128),
    "qwen3_moe": Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=16,
                                intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, decoder_sparse_step=1),
    "deepseek_v3": DeepseekV3Config(**COMMON, num_key_value_heads=4, intermediate_size=128,
                                    moe_intermediate_size=32, n_routed_experts=4,
                                    num_experts_per_tok=2, n_shared_experts=1,
                                    first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                    n_group=1, topk_group=1),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[request.param]).eval()


def test_aux_states_enter_layer_k_before_any_norm(model):
    ids = torch.randint(0, 97, (2, 11))
    layers = [0, 2, 4, 5]
    aux, final = hidden.capture(model, ids, torch.ones_like(ids), layers)
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True)
        # Independent reference: run the layers by hand and record each one's input.
        dec = model.get_decoder()
        h = dec.embed_tokens(ids)
        assert torch.equal(ref.hidden_states[0], h)
    H = model.config.hidden_size
    for i, k in enumerate(layers):
        assert torch.equal(aux[..., i * H:(i + 1) * H], ref.hidden_states[k]), k
    # The last entry of HF's tuple has the final norm applied; `final` is that, and it gives the
    # target's logits exactly.
    assert torch.allclose(final, ref.hidden_states[-1])
    assert torch.allclose(final @ model.get_output_embeddings().weight.T, ref.logits, atol=1e-5)
    # ...while an aux state is never normed: it differs from the normed version of itself.
    assert not torch.allclose(dec.norm(ref.hidden_states[5]), ref.hidden_states[5])


def test_stage_files_hold_the_captured_tensors(model, tmp_path):
    from safetensors.torch import save_file

    from draftsmith.atomic import write_json

    lengths = [5, 9, 3]
    seqs = [torch.randint(1, 97, (n,)) for n in lengths]
    tok = tmp_path / "tok"
    tok.mkdir()
    save_file({"input_ids": torch.cat(seqs).to(torch.int32),
               "loss_mask": torch.ones(sum(lengths), dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, 5, 14, 17])}, tok / "shard-00000.safetensors")
    write_json(tok / "manifest.json", {"vocab_size": 97, "shards": [
        {"file": "shard-00000.safetensors", "ids": ["a", "b", "c"]}]})
    cfg = HiddenConfig(dtype="float32", batch_size=2, shard_samples=2)
    m = hidden.write_hidden(cfg, model, [2, 4, 5], tok, tmp_path / "h", "rev", pad_id=0)
    assert m["tokens"] == 17 and m["shards"] == 2  # packed: no padding stored
    assert m["bytes_per_token"] == 4 * 64 * 4
    got = {sid: (a, f, i) for sid, a, f, i, _ in hidden.iter_hidden(tmp_path / "h")}
    for sid, seq in zip("abc", seqs):
        aux, final = hidden.capture(model, seq[None], torch.ones(1, len(seq), dtype=torch.long),
                                    [2, 4, 5])
        assert torch.equal(got[sid][2], seq)
        # Padded batching must not change a sample's states (beyond float noise).
        assert torch.allclose(got[sid][0], aux[0], atol=1e-5)
        assert torch.allclose(got[sid][1], final[0], atol=1e-5)


def test_resume_reuses_finished_shards(model, tmp_path):
    from safetensors.torch import save_file

    from draftsmith.atomic import write_json

    tok = tmp_path / "tok"
    tok.mkdir()
    save_file({"input_ids": torch.arange(1, 13, dtype=torch.int32),
               "loss_mask": torch.ones(12, dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, 4, 8, 12])}, tok / "shard-00000.safetensors")
    write_json(tok / "manifest.json", {"vocab_size": 97, "shards": [
        {"file": "shard-00000.safetensors", "ids": ["a", "b", "c"]}]})
    cfg = HiddenConfig(dtype="float32", shard_samples=1)
    hidden.write_hidden(cfg, model, [2, 4, 5], tok, tmp_path / "h", "rev", 0)
    (tmp_path / "h" / "hidden-00002.safetensors").unlink()  # "interrupted" before shard 2
    m = hidden.write_hidden(cfg, model, [2, 4, 5], tok, tmp_path / "h", "rev", 0)
    assert m["reused_shards"] == 2 and m["shards"] == 3
    # Other inputs (different layers): nothing is reused.
    m = hidden.write_hidden(cfg, model, [1, 4, 5], tok, tmp_path / "h", "rev", 0)
    assert m["reused_shards"] == 0


def test_training_reads_the_shards_by_slices(model, tmp_path):
    """The trainer's lazy reader returns each sample exactly as the whole-shard reader does."""
    from safetensors.torch import save_file

    from draftsmith.atomic import write_json
    from draftsmith.train.data import HiddenStore

    tok = tmp_path / "tok"
    tok.mkdir()
    save_file({"input_ids": torch.arange(1, 16, dtype=torch.int32),
               "loss_mask": (torch.arange(15) % 2).to(torch.uint8),
               "cu_seqlens": torch.tensor([0, 4, 9, 15])}, tok / "shard-00000.safetensors")
    write_json(tok / "manifest.json", {"vocab_size": 97, "shards": [
        {"file": "shard-00000.safetensors", "ids": ["a", "b", "c"]}]})
    hidden.write_hidden(HiddenConfig(dtype="bfloat16", shard_samples=2), model, [2, 4, 5], tok,
                        tmp_path / "h", "rev", 0)
    store = HiddenStore(tmp_path / "h")
    for i, (sid, aux, final, ids, mask) in enumerate(hidden.iter_hidden(tmp_path / "h")):
        assert store.samples[i].id == sid
        got = store.read(i)
        for a, b in zip(got, (aux, final, ids, mask)):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_training_loads_only_the_head_of_the_target(model, tmp_path):
    """Embedding, lm_head and final norm come from the safetensors alone, tied or not."""
    from draftsmith.atomic import write_json
    from draftsmith.artifacts import load_target_head

    model.save_pretrained(tmp_path / "m")  # safetensors
    write_json(tmp_path / "t" / "target.json", dict(
        kind="local", model=str(tmp_path / "m"), path=str(tmp_path / "m"), revision="x",
        chat_format="chatml", architecture="?", num_layers=8, hidden_size=64, vocab_size=97,
        trust_remote_code=False, dtype="float32"))
    config, embed, head, norm = load_target_head(tmp_path / "t")
    assert config.hidden_size == 64
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)
    assert torch.equal(norm, model.get_decoder().norm.weight)
