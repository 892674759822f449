"""Hidden states are exactly what the engines feed the drafter: the residual stream entering
layer k (vLLM: `hidden_states + residual` before layer k), before any final norm, on four
architectures; and the stage's files hold exactly those tensors."""

import pytest
import torch
from transformers import (DeepseekV3Config, LlamaConfig, Qwen3Config, Qwen3MoeConfig,
                          AutoModelForCausalLM)

from draftsmith import capture, hidden, hidden_format
from draftsmith.config import HiddenConfig
from draftsmith.errors import DraftsmithError

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
    aux, final = capture.capture(model, ids, torch.ones_like(ids), layers)
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


@pytest.fixture(params=["sdpa", "varlen"])
def attention(model, request):
    """The model set to each attention the stage packs with: SDPA over padded rows, and the
    packed varlen attention (one flat row; per-sample SDPA on a CPU)."""
    capture.set_attention(model, request.param)
    yield request.param
    model.set_attn_implementation("sdpa")


def test_stage_files_hold_the_captured_tensors(model, attention, tmp_path):
    from safetensors.torch import save_file

    from draftsmith.atomic import write_json

    lengths = [9, 3, 5]
    seqs = [torch.randint(1, 97, (n,)) for n in lengths]
    tok = tmp_path / "tok"
    tok.mkdir()
    save_file({"input_ids": torch.cat(seqs).to(torch.int32),
               "loss_mask": torch.ones(sum(lengths), dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, 9, 12, 17])}, tok / "shard-00000.safetensors")
    write_json(tok / "manifest.json", {"vocab_size": 97, "shards": [
        {"file": "shard-00000.safetensors", "ids": ["a", "b", "c"]}]})
    # Shards of 12 tokens' bytes: [a, b] then [c]; rows of 12 tokens: b packed behind a, so a
    # leak across samples would change b's states.
    cfg = HiddenConfig(dtype="float32", row_tokens=12, batch_rows=2,
                       shard_mb=12 * 4 * 64 * 4 / 2**20)
    m = hidden.write_hidden(cfg, model, [2, 4, 5], tok, tmp_path / "h", "rev", pad_id=0)
    assert m["tokens"] == 17 and m["shards"] == 2  # no padding stored
    assert m["bytes_per_token"] == 4 * 64 * 4
    got = {sid: (a, f, i) for sid, a, f, i, _ in hidden_format.iter_hidden(tmp_path / "h")}
    model.set_attn_implementation("sdpa")  # the reference: each sample alone
    for sid, seq in zip("abc", seqs):
        aux, final = capture.capture(model, seq[None], torch.ones(1, len(seq), dtype=torch.long),
                                    [2, 4, 5])
        assert torch.equal(got[sid][2], seq)
        # Packing beside other samples must not change a sample's states (beyond float noise).
        assert torch.allclose(got[sid][0], aux[0], atol=1e-5)
        assert torch.allclose(got[sid][1], final[0], atol=1e-5)


def write_tokenized(folder, seqs):
    from safetensors.torch import save_file

    from draftsmith.atomic import write_json

    folder.mkdir()
    lengths = [len(s) for s in seqs]
    save_file({"input_ids": torch.cat(seqs).to(torch.int32),
               "loss_mask": torch.ones(sum(lengths), dtype=torch.uint8),
               "cu_seqlens": torch.cumsum(torch.tensor([0, *lengths]), 0)},
              folder / "shard-00000.safetensors")
    write_json(folder / "manifest.json", {"vocab_size": 97, "shards": [
        {"file": "shard-00000.safetensors", "ids": [f"s{i}" for i in range(len(seqs))]}]})
    return folder


def test_samples_longer_than_a_row_get_a_forward_of_their_own(model, attention, tmp_path):
    """The row rule: a sample longer than hidden.row_tokens is its own row and its own forward
    (never padded beside, or stacked on, other rows), and its states are its own."""
    lengths = [20, 3, 5, 14, 2, 7]
    seqs = [torch.randint(1, 97, (n,)) for n in lengths]
    rows = hidden.pack_rows(lengths, 12)
    forwards = hidden.plan_forwards(rows, lengths, 12, 2)
    assert forwards[:2] == [[[0]], [[3]]]  # the two long ones, alone
    assert all(len(f) <= 2 for f in forwards)
    assert [r for f in forwards for r in f] == rows  # the stored order is the rows' order
    cfg = HiddenConfig(dtype="float32", row_tokens=12, batch_rows=2)
    m = hidden.write_hidden(cfg, model, [2, 4, 5], write_tokenized(tmp_path / "tok", seqs),
                            tmp_path / "h", "rev", pad_id=0)
    assert m["tokens"] == sum(lengths)
    got = {sid: (a, f) for sid, a, f, _, _ in hidden_format.iter_hidden(tmp_path / "h")}
    model.set_attn_implementation("sdpa")
    for i, seq in enumerate(seqs):
        aux, final = capture.capture(model, seq[None], torch.ones(1, len(seq), dtype=torch.long),
                                    [2, 4, 5])
        assert torch.allclose(got[f"s{i}"][0], aux[0], atol=1e-5)
        assert torch.allclose(got[f"s{i}"][1], final[0], atol=1e-5)


def test_a_forward_never_holds_more_than_its_budget_or_the_longest_sample():
    import random

    rng = random.Random(1)
    lengths = [int(rng.lognormvariate(4, 1.2)) + 1 for _ in range(400)]
    rows = hidden.pack_rows(lengths, 64)
    forwards = hidden.plan_forwards(rows, lengths, 64, 4)
    assert [r for f in forwards for r in f] == rows
    for f in forwards:
        tokens = sum(lengths[i] for r in f for i in r)
        assert tokens <= 64 * 4 or (len(f) == 1 and len(f[0]) == 1)


def test_samples_beyond_the_targets_window_are_refused_before_loading_it(toy_target, tmp_path):
    from draftsmith.target_info import context_length

    window = context_length(toy_target)
    tok = write_tokenized(tmp_path / "tok", [torch.randint(1, 97, (n,))
                                             for n in (5, window + 1, window + 7)])
    with pytest.raises(DraftsmithError) as e:
        hidden.run(HiddenConfig(), toy_target, tok, tmp_path / "h")
    assert f"2 sample(s) are longer than the target's context window of {window}" in str(e.value)
    assert "sample s2" in str(e.value) and "tokenize.max_length" in str(e.value)
    assert not (tmp_path / "h").exists()


def test_packed_rows_in_varlen_equal_the_masked_rows(model):
    """Online mode's rows (samples end to end, padding at the end, pos restarting per sample)
    through the varlen attention equal the same rows through SDPA's block-diagonal mask."""
    ids = torch.randint(1, 97, (2, 16))
    pos = torch.tensor([[*range(9), *range(5), 0, 1], [*range(16)]])
    want = capture.capture_rows(model, ids, pos, [2, 4, 5])
    capture.set_attention(model, "varlen")
    try:
        got = capture.capture_rows(model, ids, pos, [2, 4, 5])
    finally:
        model.set_attn_implementation("sdpa")
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


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
    cfg = HiddenConfig(dtype="float32", shard_mb=4 * 4 * 64 * 4 / 2**20)  # a sample a shard
    hidden.write_hidden(cfg, model, [2, 4, 5], tok, tmp_path / "h", "rev", 0)
    (tmp_path / "h" / "hidden-00002.safetensors").unlink()  # "interrupted" before shard 2
    m = hidden.write_hidden(cfg, model, [2, 4, 5], tok, tmp_path / "h", "rev", 0)
    assert m["reused_shards"] == 2 and m["shards"] == 3
    # Other inputs (different layers): nothing is reused.
    m = hidden.write_hidden(cfg, model, [1, 4, 5], tok, tmp_path / "h", "rev", 0)
    assert m["reused_shards"] == 0


def test_a_change_in_the_capture_code_recomputes_every_shard(model, tmp_path, monkeypatch):
    """dvc repro reruns the stage when its code changed; the shards the earlier code wrote must
    not come back as this run's (a capture fix would silently not apply)."""
    tok = write_tokenized(tmp_path / "tok", [torch.randint(1, 97, (4,)) for _ in range(3)])
    cfg = HiddenConfig(dtype="float32", shard_mb=4 * 4 * 64 * 4 / 2**20)  # a sample a shard
    hidden.write_hidden(cfg, model, [2, 4, 5], tok, tmp_path / "h", "rev", 0)
    m = hidden.write_hidden(cfg, model, [2, 4, 5], tok, tmp_path / "h", "rev", 0)
    assert m["reused_shards"] == 3  # the same code and inputs: a rerun reuses them
    monkeypatch.setattr(hidden, "code_fingerprint", lambda: "other code")
    m = hidden.write_hidden(cfg, model, [2, 4, 5], tok, tmp_path / "h", "rev", 0)
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
    hidden.write_hidden(HiddenConfig(dtype="bfloat16", shard_mb=9 * 4 * 64 * 2 / 2**20), model,
                        [2, 4, 5], tok,
                        tmp_path / "h", "rev", 0)
    store = HiddenStore(tmp_path / "h")
    for i, (sid, aux, final, ids, mask) in enumerate(hidden_format.iter_hidden(tmp_path / "h")):
        assert store.samples[i].id == sid
        got = store.read(i)
        for a, b in zip(got, (aux, final, ids, mask)):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_training_loads_only_the_head_of_the_target(model, tmp_path):
    """Embedding, lm_head and final norm come from the safetensors alone, tied or not."""
    from draftsmith.atomic import write_json
    from draftsmith.target_info import load_target_head

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


def _tokenized(tmp_path, lengths, seed=0):
    from safetensors.torch import save_file

    from draftsmith.atomic import write_json

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, 97, (n,), generator=g) for n in lengths]
    tok = tmp_path / "tok"
    tok.mkdir()
    save_file({"input_ids": torch.cat(seqs).to(torch.int32),
               "loss_mask": (torch.rand(sum(lengths), generator=g) < 0.7).to(torch.uint8),
               "cu_seqlens": torch.cumsum(torch.tensor([0, *lengths]), 0)},
              tok / "shard-00000.safetensors")
    ids = [f"s{i}" for i in range(len(lengths))]
    write_json(tok / "manifest.json", {"vocab_size": 97, "shards": [
        {"file": "shard-00000.safetensors", "ids": ids}]})
    return tok, dict(zip(ids, seqs))


def test_pack_rows_and_shards_place_every_sample_once():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(300)] + [90]  # one longer than a row
    rows = hidden.pack_rows(lengths, 64)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows if row != [300])
    assert [300] in rows  # the long one alone
    fill = sum(lengths) / sum(max(64, sum(lengths[i] for i in r)) for r in rows)
    assert fill > 0.95  # longest first, first fit: rows come out nearly full
    shards = hidden.plan_shards(lengths, 10, 2000)
    assert [i for s in shards for i in s] == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in s) * 10 <= 2000 or len(s) == 1 for s in shards)


def test_fp8_storage_halves_the_bytes_and_reads_back_close(model, tmp_path):
    """hidden.dtype float8_e4m3fn: one scale per token and layer, dequantized when training
    reads; every state within fp8's rounding of the bf16 one."""
    from draftsmith.train.data import HiddenStore

    tok, seqs = _tokenized(tmp_path, [7, 12, 5, 9])
    layers = [2, 4, 5]
    ref = hidden.write_hidden(HiddenConfig(dtype="bfloat16", row_tokens=16), model, layers, tok,
                              tmp_path / "bf16", "rev", 0)
    got = hidden.write_hidden(HiddenConfig(dtype="float8_e4m3fn", row_tokens=16), model, layers,
                              tok, tmp_path / "fp8", "rev", 0)
    H = model.config.hidden_size
    assert got["bytes_per_token"] == 4 * (H + 4) and ref["bytes_per_token"] == 4 * H * 2
    files = sorted((tmp_path / "fp8").glob("hidden-*.safetensors"))
    assert sum(f.stat().st_size for f in files) < 0.6 * sum(
        f.stat().st_size for f in (tmp_path / "bf16").glob("hidden-*.safetensors"))
    a, b = HiddenStore(tmp_path / "bf16"), HiddenStore(tmp_path / "fp8")
    for i, s in enumerate(a.samples):
        j = next(j for j, t in enumerate(b.samples) if t.id == s.id)
        (aux, fin, ids, mask), (qa, qf, qids, qmask) = a.read(i), b.read(j)
        assert qa.dtype == torch.bfloat16 and torch.equal(ids, qids) and torch.equal(mask, qmask)
        for x, q in ((aux.float(), qa.float()), (fin.float(), qf.float())):
            rel = (q - x).norm(dim=-1) / x.norm(dim=-1)
            assert rel.max() < 0.08, float(rel.max())  # e4m3: 3 mantissa bits
            assert rel.max() > 0  # really quantized


def test_online_states_equal_the_stored_ones(model, tmp_path):
    """hidden.mode online: the trainer computes each packed batch's states itself; they equal
    what the offline stage stores for the same tokens."""
    from draftsmith.config import TrainConfig
    from draftsmith.train.data import HiddenStore, TokenStore, make_batch
    from draftsmith.train.sources import open_source
    from draftsmith.target_info import TargetHead
    from draftsmith.train.loop import Runtime, Trainer, build_drafter

    tok, _ = _tokenized(tmp_path, [7, 12, 5, 9, 3])
    layers = [2, 4, 5]
    hidden.write_hidden(HiddenConfig(dtype="float32", row_tokens=16), model, layers, tok,
                        tmp_path / "off", "rev", 0)
    m = hidden.write_online_manifest(layers, 64, tmp_path / "on")
    assert m["bytes"] == 0 and [f.name for f in (tmp_path / "on").iterdir()] == ["manifest.json"]
    with pytest.raises(Exception, match="no tokenized data"):
        open_source(tmp_path / "on")
    with pytest.raises(Exception, match="target model was not given"):
        open_source(tmp_path / "on", tok)
    online = open_source(tmp_path / "on", tok, load_target=lambda device: model)
    offline = open_source(tmp_path / "off", tok)
    assert (online.mode, offline.mode) == ("online", "offline")
    online, offline = online.store, offline.store
    assert type(online) is TokenStore and type(offline) is HiddenStore
    by_id = {s.id: i for i, s in enumerate(offline.samples)}
    rows = [[0, 1], [2, 3, 4]]
    on = make_batch(online, rows, 24)
    off = make_batch(offline, [[by_id[online.samples[i].id] for i in r] for r in rows], 24)
    assert on.aux.shape[-1] == 0 and torch.equal(on.ids, off.ids)
    cfg = TrainConfig(seq_len=24, device="cpu")
    V, H = 97, 64
    head = TargetHead(model.config, model.get_input_embeddings().weight.detach(),
                      model.get_output_embeddings().weight.detach(), torch.ones(H))
    d2t, t2d = torch.zeros(8, dtype=torch.long), torch.zeros(V, dtype=torch.bool)
    t2d[:8] = True
    trainer = Trainer(cfg, Runtime.resolve(cfg), build_drafter(cfg, head, d2t, t2d, layers),
                      head, target=model)
    filled = trainer.with_target_states(on)
    real = on.doc >= 0
    assert torch.allclose(filled.aux[real], off.aux[real].float(), atol=1e-5)
    assert torch.allclose(filled.final[real], off.final[real].float(), atol=1e-5)


def test_both_modes_train_on_the_same_batches(model, tmp_path):
    """The training schedule follows the sample ids, not where the hidden stage stored each
    sample: offline shards (here packed longest first) and online mode give the same steps."""
    from draftsmith.train.data import eval_steps, schedule
    from draftsmith.train.sources import open_source

    tok, _ = _tokenized(tmp_path, [7, 12, 5, 9, 3, 11, 2])
    hidden.write_hidden(HiddenConfig(row_tokens=16), model, [2, 4, 5], tok, tmp_path / "off",
                        "rev", 0)
    hidden.write_online_manifest([2, 4, 5], 64, tmp_path / "on")
    stores = [open_source(tmp_path / "off", tok).store,
              open_source(tmp_path / "on", tok, load_target=lambda device: model).store]
    assert [s.id for s in stores[0].samples] != [s.id for s in stores[1].samples]

    def steps(store, epoch):
        train, held = store.split(2)
        return [[[store.samples[i].id for i in row] for row in step]
                for step in [*schedule(store, train, 24, 2, 0, epoch),
                             *eval_steps(store, held, 24, 2)]]

    for epoch in (0, 1):
        assert steps(stores[0], epoch) == steps(stores[1], epoch)


def test_the_extraction_benchmark_runs_at_toy_size(tmp_path):
    """benchmarks/hidden_extract.py keeps working between GPU runs: its toy preset on the CPU."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "hidden_extract.py"
    want = ["padded_hf", "before", "packed", "packed_fp8", "packed_flex", "packed_varlen_sdpa",
            "writes", "equal", "equal_hf"]
    subprocess.run([sys.executable, str(script), "--preset", "toy", "--device", "cpu",
                    "--mix", "60,1.2,400,12,2", "--kinds", *want, "--json",
                    str(tmp_path / "r.json")], check=True, capture_output=True, timeout=600)
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["mix"] == {"median": 60, "sigma": 1.2, "cap": 400, "samples": 12, "seed": 2}
    assert max(out["lengths"]) > 256  # the tail passes the toy's row_tokens
    kinds = {r["kind"]: r for r in out["results"]}
    assert set(kinds) == set(want)
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in kinds.values())
    assert kinds["packed_fp8"]["bytes_per_token"] < 0.6 * kinds["packed"]["bytes_per_token"]
    assert kinds["writes"]["gb_per_s"] > 0


def test_the_attention_kernels_benchmark_runs_at_toy_size(tmp_path):
    """benchmarks/varlen_attention.py keeps working between GPU runs: on the CPU, SDPA alone."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "varlen_attention.py"
    subprocess.run([sys.executable, str(script), "--preset", "toy", "--device", "cpu", "--json",
                    str(tmp_path / "r.json")], check=True, capture_output=True, timeout=600)
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert {r["row"] for r in results} == {"4x32", "1x128", "tail"}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in results)


def test_shards_written_from_tensor_memory_are_standard_safetensors(tmp_path):
    """safetensors_write.save_hashed: every dtype a shard holds reads back equal through the
    safetensors library (whole and by slice), and the digest is the written file's."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from draftsmith.atomic import file_sha256
    from draftsmith.hidden.safetensors_write import save_hashed

    t = {"aux": torch.randn(5, 12).to(torch.bfloat16),
         "final": (torch.randn(5, 4) * 10).to(torch.float8_e4m3fn),
         "aux_scale": torch.rand(5, 3), "input_ids": torch.arange(5, dtype=torch.int32),
         "loss_mask": torch.ones(5, dtype=torch.uint8), "cu_seqlens": torch.tensor([0, 2, 5]),
         "empty": torch.empty(0, 4), "flags": torch.tensor([True, False]),
         "wide": torch.randn(3, 2, dtype=torch.float64)[:, :1]}  # a non-contiguous view
    path = tmp_path / "s.safetensors"
    digest = save_hashed(t, path)
    assert digest == {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    back = load_file(path)
    assert set(back) == set(t)
    for k, v in t.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8),
                                                        v.contiguous().view(torch.uint8)), k
    with safe_open(path, "pt") as f:
        assert torch.equal(f.get_slice("aux")[1:3], t["aux"][1:3])


def test_states_kept_by_an_online_run_become_the_artifact_only_when_they_fit(
        toy_target, toy_data, tmp_path, capsys):
    """hidden.kept_from: a folder of states kept by an online run (hidden.online_keep; here the
    toy's stored states laid out as one, its key computed as the train stage computes it) is
    taken as the artifact, shard by shard with its sha256 checked, before any engine starts;
    a folder kept for other inputs, one missing samples, or another engine's, is left, saying
    why; a shard that does not match its sha256 stops the stage, naming it."""
    import json
    import shutil

    from draftsmith.artifacts import sample_lengths
    from draftsmith.hidden_format import kept_key, read_hidden_manifest

    tok = toy_data / "tok"
    stored = read_hidden_manifest(toy_data / "hidden")
    layers, lengths = stored["aux_layers"], sample_lengths(tok)
    kept = tmp_path / "kept"
    shutil.copytree(toy_data / "hidden", kept)
    key = kept_key(toy_target, tok, layers, "float32")
    (kept / "manifest.json").write_text(json.dumps({**stored, "key": key}))
    cfg = HiddenConfig(engine="vllm", dtype="float32", aux_layers=layers, kept_from=str(kept))

    m = hidden.run(cfg, toy_target, tok, tmp_path / "out")  # no server: none is configured
    assert m["adopted_kept_shards"] == len(stored["shards"]) and m["samples"] == len(lengths)
    want = {sid: (a, f) for sid, a, f, _, _ in hidden_format.iter_hidden(toy_data / "hidden")}
    got = {sid: (a, f) for sid, a, f, _, _ in hidden_format.iter_hidden(tmp_path / "out")}
    assert got.keys() == want.keys()
    assert all(torch.equal(got[s][0], want[s][0]) and torch.equal(got[s][1], want[s][1])
               for s in got)

    def refused(why: str, config=cfg, key=key):
        assert hidden.adopt_kept(kept, config, key, lengths, tmp_path / "no") is None
        assert why in capsys.readouterr().out and not (tmp_path / "no").exists()

    refused("kept for other samples, target, layers or dtype",
            key=kept_key(toy_target, tok, layers, "bfloat16"))
    refused("kept states are vLLM's", config=cfg.model_copy(update={"engine": "hf"}))
    first = stored["shards"][0]  # a sample short (as an online run killed in its 1st epoch)
    fewer = {**first, "ids": first["ids"][:-1], "lengths": first["lengths"][:-1]}
    (kept / "manifest.json").write_text(json.dumps(
        {**stored, "key": key, "shards": [fewer, *stored["shards"][1:]]}))
    refused(f"it holds {len(lengths) - 1} of the {len(lengths)} samples")
    (kept / "manifest.json").write_text(json.dumps({**stored, "key": key}))
    shard = kept / stored["shards"][0]["file"]
    with pytest.raises(ValueError, match="kept_from.*Set hidden.mode: offline"):
        HiddenConfig(mode="online", kept_from=str(kept))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # one bit pattern flipped
    with pytest.raises(DraftsmithError, match=f"(?s){shard.name} does not match its sha256"
                                              ".*unset hidden.kept_from"):
        hidden.adopt_kept(kept, cfg, key, lengths, tmp_path / "bad")
