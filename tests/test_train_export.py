"""Drafter training on the tiny target's own data, then export and validation."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import export, train
from draftsmith.checkpoint import DRAFTER_WEIGHTS
from draftsmith.config import ExportConfig, TrainConfig
from draftsmith.errors import DraftsmithError
from draftsmith.target_info import read_info
from draftsmith.train.loop import Trainer

TRAIN = TrainConfig(steps=60, seq_len=256, batch_size=2, lr=3e-3, ttt_steps=3, eval_samples=16,
                    save_every=25, log_every=5, warmup_steps=5, num_workers=0)


@pytest.fixture(scope="module")
def data(toy_data):
    return toy_data


@pytest.fixture(scope="module")
def trained(toy_target, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    metrics = train.run(TRAIN, toy_target, data / "hidden", data / "vocab", out / "drafter",
                        out / "ckpt", out / "curve.csv")
    return out, metrics


def test_training_beats_random_init(trained):
    _, m = trained
    acc, init = m["eval_accuracy"], m["initial_eval_accuracy"]
    assert len(acc) == 3 and m["eval_positions"] > 100
    assert acc[0] > init[0] + 0.2, (acc, init)
    assert acc[0] > 0.4


def test_scratch_init_is_a_weak_baseline(toy_target, data, tmp_path):
    cfg = TRAIN.model_copy(update={"init": "scratch", "steps": 1})
    m = train.run(cfg, toy_target, data / "hidden", data / "vocab", tmp_path / "d",
                  tmp_path / "c")
    assert m["initial_eval_accuracy"][0] < 0.2


def test_curve_is_written(trained):
    out, _ = trained
    lines = (out / "curve.csv").read_text().splitlines()
    assert lines[0].startswith("step,loss,acc_0,acc_1,acc_2") and len(lines) > 10


def _interrupt_final_eval(monkeypatch):
    """The initial evaluation runs; the final one (after the last checkpoint) is "Ctrl-C"."""
    real, calls = Trainer.evaluate, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(Trainer, "evaluate", interrupted)


def test_interrupted_training_resumes_to_the_same_drafter(toy_target, data, trained, tmp_path,
                                                         monkeypatch):
    out, _ = trained
    _interrupt_final_eval(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train.run(TRAIN, toy_target, data / "hidden", data / "vocab", tmp_path / "d",
                  tmp_path / "ckpt")
    monkeypatch.undo()
    assert not (tmp_path / "d").exists()  # nothing half-written
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["step"] == 50
    m = train.run(TRAIN, toy_target, data / "hidden", data / "vocab", tmp_path / "d",
                  tmp_path / "ckpt")
    assert m["resumed_from_step"] == 50
    assert not (tmp_path / "ckpt").exists()  # finished: the resume point is cleared
    a = load_file(out / "drafter" / DRAFTER_WEIGHTS)
    b = load_file(tmp_path / "d" / DRAFTER_WEIGHTS)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # one flipped byte in the middle: same size, different content
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)


@pytest.mark.faults
@pytest.mark.parametrize("how", ["corrupted", "truncated"])
def test_damaged_hidden_shard_is_refused_before_training(toy_target, data, tmp_path, how,
                                                         fault_row):
    h = tmp_path / "hidden"
    shutil.copytree(data / "hidden", h)
    shard = sorted(h.glob("hidden-*.safetensors"))[0]
    _damage(shard, how)
    with pytest.raises(DraftsmithError, match=f"(?s){shard.name} is {how}.*dvc repro hidden"):
        train.run(TRAIN, toy_target, h, data / "vocab", tmp_path / "d", tmp_path / "c")
    assert not (tmp_path / "d").exists() and not list((tmp_path / "c").glob("*"))
    fault_row(f"hidden-state shard {how}", "train refuses before reading it, naming the shard "
              "and the fix (sha256/size from the manifest)")


@pytest.mark.faults
@pytest.mark.parametrize("how", ["corrupted", "truncated"])
def test_damaged_checkpoint_is_refused_not_resumed(toy_target, data, tmp_path, monkeypatch,
                                                   how, fault_row):
    _interrupt_final_eval(monkeypatch)  # a checkpoint of step 50 is left
    with pytest.raises(KeyboardInterrupt):
        train.run(TRAIN, toy_target, data / "hidden", data / "vocab", tmp_path / "d",
                  tmp_path / "ckpt")
    monkeypatch.undo()
    _damage(tmp_path / "ckpt" / "optimizer.pt", how)
    with pytest.raises(DraftsmithError, match=f"(?s)optimizer.pt is {how}.*delete .*ckpt"):
        train.run(TRAIN, toy_target, data / "hidden", data / "vocab", tmp_path / "d",
                  tmp_path / "ckpt")
    assert not (tmp_path / "d").exists()
    fault_row(f"training checkpoint {how}", "train refuses to resume from it, naming the file "
              "and the fix (sha256/size in state.json)")


@pytest.fixture(scope="module")
def exported(toy_target, trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "export"
    m = export.run(ExportConfig(), toy_target, trained[0] / "drafter", out)
    return out, m


def _target_shape(toy_target):
    info = read_info(toy_target)
    return dict(target_num_layers=info.num_layers, target_hidden_size=info.hidden_size,
                target_vocab_size=info.vocab_size)


def test_export_layout_for_both_engines(toy_target, exported):
    out, m = exported
    vcfg = json.loads((out / "vllm" / "config.json").read_text())
    scfg = json.loads((out / "sglang" / "config.json").read_text())
    assert vcfg["architectures"] == ["LlamaForCausalLMEagle3"]
    layers = vcfg["eagle_aux_hidden_state_layer_ids"]
    assert layers == vcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert scfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert "eagle_aux_hidden_state_layer_ids" not in scfg
    t = load_file(out / "vllm" / "model.safetensors")
    assert {"d2t", "t2d", "fc.weight", "norm.weight", "lm_head.weight",
            "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight"} <= set(t)
    assert "embed_tokens.weight" not in t
    assert t["fc.weight"].dtype == torch.bfloat16 and t["d2t"].dtype == torch.int64
    assert m["vllm_aux_layer_ids"] == [2, 3, 4]
    for engine in ("vllm", "sglang"):
        export.validate(out / engine, **_target_shape(toy_target))


def _corrupt(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, dst / "model.safetensors")
    if config:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def _ids_not_offsets(t):
    t["d2t"] = t["d2t"] + torch.arange(len(t["d2t"]))


def _wrong_layers(c):
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    c["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]


@pytest.mark.parametrize("name, tensors, config, needle", [
    ("missing_d2t", lambda t: t.pop("d2t"), None, "tensor d2t is missing"),
    ("d2t_as_ids", _ids_not_offsets, None, "it holds target ids; engines read OFFSETS"),
    ("wrong_layers", None, _wrong_layers, "do not match the layers trained on"),
    ("layers_out_of_range", None,
     lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 40],
                        eagle_config={**c["eagle_config"],
                                      "eagle_aux_hidden_state_layer_ids": [2, 3, 40]}),
     "out of range"),
    ("top_level_disagrees", None, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4]),
     "what vLLM reads"),
    ("wrong_shape", lambda t: t.update({"fc.weight": t["fc.weight"][:, :-8].contiguous()}), None,
     "tensor fc.weight has shape"),
    ("wrong_dtype", lambda t: t.update({"d2t": t["d2t"].to(torch.int32)}), None,
     "d2t has dtype torch.int32"),
    ("normed_before_fc", None, lambda c: c["eagle_config"].update(norm_before_fc=True),
     "trained on them un-normalized (captured before the norm"),
])
def test_corrupted_exports_fail_clearly(toy_target, exported, tmp_path, name, tensors, config,
                                        needle):
    bad = _corrupt(exported[0] / "vllm", tmp_path / name, tensors, config)
    with pytest.raises(DraftsmithError) as e:
        export.validate(bad, **_target_shape(toy_target))
    assert needle in str(e.value)


def test_finetune_from_existing_drafter_in_both_layouts(toy_target, data, trained, exported,
                                                       tmp_path):
    src = exported[0] / "vllm"
    # The speculators layout names the layer `layers.0.` instead of `midlayer.`.
    spec = tmp_path / "speculators"
    spec.mkdir()
    t = load_file(src / "model.safetensors")
    save_file({k.replace("midlayer.", "layers.0.", 1): v for k, v in t.items()},
              spec / "model.safetensors")
    for path in (src, spec):
        cfg = TRAIN.model_copy(update={"init": str(path), "steps": 1})
        m = train.run(cfg, toy_target, data / "hidden", data / "vocab", tmp_path / "d",
                      tmp_path / f"c{path.name}")
        # It starts where training ended (the export is bf16: within 10%), far above where a
        # fresh drafter starts.
        assert m["initial_eval_accuracy"][0] > 0.9 * trained[1]["eval_accuracy"][0]
        assert m["initial_eval_accuracy"][0] > trained[1]["initial_eval_accuracy"][0] + 0.2
