"""The seed story's case on a CPU: an MLA + MoE target (the embedded MLA toy, DeepSeek-V3
architecture like Kimi-K2.5) from `target` to a drafter served by a live vLLM, and the seed's
failure (a drafter exported in the other engine's aux-layer convention, its states normed)
shown in vLLM's own counters and caught by `draftsmith validate` before serving.

A small MLA toy keeps this to a few minutes; `make repro` with `target.model: embedded-mla`
builds the full-size one (figures in the README)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, REPORT, cached_checkout, dvc
from test_pipeline_dvc import set_params
from draftsmith.toy.recipes import TINY_MLA_TARGET
from test_vllm import COMMAND, EXTRA, cpu_server, held_out_greedy
from draftsmith import benchmark
from draftsmith.config import BenchmarkConfig

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

MLA = {
    "target": {"model": "embedded-mla", "embedded": TINY_MLA_TARGET},
    "generate": {"num_samples": 300, "max_new_tokens": 96, "batch_size": 32},
    "tokenize": {"on_format_error": "drop"},
    "vocab": {"draft_vocab_size": 128},
    "train": {"steps": 300, "eval_samples": 16},
    "benchmark": {"num_prompts": 30, "temperatures": [0.0], "max_new_tokens": 96,
                  "engines": ["reference", "vllm"]},
    "server": {"command": COMMAND, "extra_args": EXTRA},
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A checkout with the MLA toy's whole pipeline run through `dvc repro`, the benchmark
    stage serving the target and its exported drafter in vLLM."""
    repo = cached_checkout(tmp_path_factory, "mla", MLA)
    dvc("repro", cwd=repo)
    return repo


def test_mla_target_with_its_drafter_in_vllm(repo):
    target = json.loads((repo / "metrics/target.json").read_text())
    assert target["kind"] == "embedded" and target["num_layers"] == TINY_MLA_TARGET["num_layers"]
    assert json.loads((repo / "models/target/model/config.json").read_text())[
        "architectures"] == ["DeepseekV3ForCausalLM"]
    m = json.loads((repo / "metrics/benchmark.json").read_text())
    ref, served = m["by_engine"]["reference"]["T0.0"], m["by_engine"]["vllm"]["T0.0"]
    REPORT.append(f"MLA toy, acceptance length, greedy, k={m['k']}, {m['samples']} prompts: "
                  f"reference {ref}, vLLM {served}, random drafter "
                  f"{m['random_drafter_acceptance_length']}")
    assert abs(served - ref) <= 0.10 * ref
    assert served > 1.5 * m["random_drafter_acceptance_length"]
    vllm_t0 = m["by_engine_results"]["vllm"][0]
    assert vllm_t0["temperature"] == 0.0 and vllm_t0["lossless"]["lossless"]


def test_seed_failure_other_convention_loses_acceptance_and_validate_names_it(repo, tmp_path):
    """The drafter exported as a trainer with the other convention writes it: aux ids as
    "output of layer i" (SGLang's, one lower) where vLLM reads "input of layer k", and the
    captured states normed before fc."""
    good = repo / "models/export/vllm"
    wrong = tmp_path / "other-convention"
    wrong.mkdir()
    c = json.loads((good / "config.json").read_text())
    ids = [k - 1 for k in c["eagle_aux_hidden_state_layer_ids"]]
    c["eagle_aux_hidden_state_layer_ids"] = ids
    c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=ids, norm_before_fc=True)
    (wrong / "config.json").write_text(json.dumps(c))
    (wrong / "model.safetensors").symlink_to(good / "model.safetensors")

    def validate(d):
        return subprocess.run([sys.executable, "-m", "draftsmith.cli", "validate", str(d),
                               "--target", str(repo / "models/target")],
                              cwd=REPO, capture_output=True, text=True)

    assert validate(good).returncode == 0
    proc = validate(wrong)
    assert proc.returncode == 2
    assert "do not match the layers trained on" in proc.stderr and "convention" in proc.stderr
    assert "captured before the norm" in proc.stderr

    # Served anyway, on the benchmark's prompts, beside the target alone.
    cfg = BenchmarkConfig(num_prompts=30, temperatures=[0.0], max_new_tokens=96)
    prompts, tok, alone = held_out_greedy(cfg, repo)
    results, texts = benchmark.served_acceptance(cfg, cpu_server(), repo / "models/target", wrong,
                                               prompts, tmp_path / "serve")
    al_wrong = results[0]["acceptance_length"]
    al_good = json.loads((repo / "metrics/benchmark.json").read_text())["by_engine"]["vllm"]["T0.0"]
    REPORT.append(f"MLA toy in vLLM: acceptance length {al_good} as exported, {al_wrong} with "
                  "the other engine's aux-layer convention and normed states")
    # Judged by the share of the drafter's gain (acceptance length - 1) it keeps, beside the
    # good export in the same run (README: 2.90 -> 2.01 keeps 53%), not by a fixed gap that a
    # toy trained on another CPU could miss.
    assert al_wrong - 1 < 0.75 * (al_good - 1)
    # Greedy output is the target's own, token for token, whatever the drafter.
    same = sum(tok.decode(texts[0.0][p.id], skip_special_tokens=False) == o.text
               for p, o in zip(prompts, alone))
    REPORT.append(f"MLA toy: vLLM greedy outputs identical to the target alone: {same}/{len(prompts)}")
    assert same == len(prompts)


def test_the_mla_drafter_on_the_same_data_served_beside_the_llama_one(repo):
    """`train.drafter_arch: mla`: the drafter layer vLLM loads as Eagle3DeepseekV2ForCausalLM
    (the target's own MLA), trained on the same hidden states as the Llama drafter: only
    train, export and benchmark rerun (or come from the run cache), and vLLM's acceptance agrees with the reference engine's
    (a rope, latent or weight-name mismatch between our layer and vLLM's would part them),
    greedy outputs the target's own."""
    from test_pipeline_dvc import brought_up_to_date

    llama = json.loads((repo / "metrics/benchmark.json").read_text())
    set_params(repo, {"train": {"drafter_arch": "mla"}})
    try:
        assert brought_up_to_date(dvc("repro", cwd=repo)) == ["train", "export", "benchmark"]
        config = json.loads((repo / "models/export/vllm/config.json").read_text())
        assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        assert json.loads((repo / "metrics/train.json").read_text())["drafter_arch"] == "mla"
        m = json.loads((repo / "metrics/benchmark.json").read_text())
    finally:  # the other tests read the Llama drafter's run (restored from DVC's run cache)
        set_params(repo, {"train": {"drafter_arch": "llama"}})
        dvc("repro", cwd=repo)
    ref, served = m["by_engine"]["reference"]["T0.0"], m["by_engine"]["vllm"]["T0.0"]
    REPORT.append(
        f"MLA toy, acceptance length at T=0, reference / vLLM: Llama drafter "
        f"{llama['by_engine']['reference']['T0.0']} / {llama['by_engine']['vllm']['T0.0']}, "
        f"MLA drafter {ref} / {served}")
    assert abs(served - ref) <= 0.10 * ref
    assert served > 1.5 * m["random_drafter_acceptance_length"]
    assert m["by_engine_results"]["vllm"][0]["lossless"]["lossless"]
