"""End to end through DVC itself: a fresh checkout, `dvc repro` on small params, then the
caching behaviour users rely on."""

import json

import pytest
import yaml

from conftest import copy_repo, dvc
from draftsmith.toy.recipes import TINY_TARGET

pytestmark = pytest.mark.e2e

SMALL = {
    "target": {"embedded": TINY_TARGET},
    "generate": {"num_samples": 48, "max_new_tokens": 96, "batch_size": 16},
    "tokenize": {"on_format_error": "drop"},
    "vocab": {"draft_vocab_size": 128},
    "train": {"steps": 30, "ttt_steps": 2, "eval_samples": 8, "warmup_steps": 3, "lr": 3e-3},
    "benchmark": {"num_prompts": 6, "temperatures": [0.0], "max_new_tokens": 64},
}
ALL = ["target", "generate", "tokenize", "vocab", "hidden", "train", "export", "benchmark"]


def set_params(repo, updates):
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for section, values in updates.items():
        for k, v in values.items():
            if isinstance(v, dict):
                params[section][k].update(v)
            else:
                params[section][k] = v
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def ran(proc) -> list[str]:
    return [line.split("'")[1] for line in proc.stdout.splitlines() if line.startswith("Running stage")]


def brought_up_to_date(proc) -> list[str]:
    """The stages `dvc repro` ran or restored from DVC's run cache. A test whose repo shares the
    persistent test cache can find a stage's outputs there from an earlier run of the suite,
    so it counts both."""
    return [line.split("'")[1] for line in proc.stdout.splitlines()
            if line.startswith("Running stage") or "is cached - skipping run" in line]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = copy_repo(tmp_path_factory.mktemp("clone"))
    set_params(repo, SMALL)
    first = dvc("repro", cwd=repo)
    assert ran(first) == ALL
    return repo


def test_metrics_of_every_stage(repo):
    gen = json.loads((repo / "metrics/generate.json").read_text())
    assert gen["samples"] == 48 and gen["errors"] == 0
    tok = json.loads((repo / "metrics/tokenize.json").read_text())
    assert tok["format_check_pass_rate"] == 1.0 and tok["samples_kept"] > 0
    bench = json.loads((repo / "metrics/benchmark.json").read_text())
    assert bench["k"] == 3 and bench["samples"] == 6 and bench["acceptance_length"] >= 1.0
    # The engine's outputs are the target's own at every temperature measured.
    assert [r["lossless"]["lossless"] for r in bench["results"]] == [True] * len(bench["results"])
    assert json.loads((repo / "metrics/export.json").read_text())["vllm_aux_layer_ids"] == [2, 3, 4]
    target = json.loads((repo / "metrics/target.json").read_text())
    assert target["kind"] == "embedded" and target["heldout_loss"] < 3.0


def test_second_repro_reruns_nothing(repo):
    again = dvc("repro", cwd=repo)
    assert ran(again) == []
    assert "didn't change, skipping" in again.stdout


def test_tokenize_param_reruns_only_tokenize(repo):
    set_params(repo, {"tokenize": {"max_length": 400}})
    assert ran(dvc("repro", "tokenize", cwd=repo)) == ["tokenize"]


def test_train_param_reruns_only_train_and_what_follows(repo):
    set_params(repo, {"train": {"lr": 2e-3}})
    assert ran(dvc("repro", cwd=repo)) == ["train", "export", "benchmark"]


def test_the_method_param_reruns_only_train_and_what_follows(repo):
    """`train.method` changes the drafter, not the data: the same hidden states serve every
    method (each reads the artifact's aux layers), so nothing before train reruns; and back
    on EAGLE-3 its run comes from DVC's run cache."""
    set_params(repo, {"train": {"method": "dflash"}})
    assert ran(dvc("repro", cwd=repo)) == ["train", "export", "benchmark"]
    assert json.loads((repo / "metrics/train.json").read_text())["method"] == "dflash"
    bench = json.loads((repo / "metrics/benchmark.json").read_text())
    assert bench["method"] == "dflash" and bench["results"][0]["lossless"]["lossless"]
    export = json.loads((repo / "models/export/vllm/config.json").read_text())
    assert export["architectures"] == ["DFlashDraftModel"]
    set_params(repo, {"train": {"method": "eagle3"}})
    proc = dvc("repro", cwd=repo)
    assert ran(proc) == [] and brought_up_to_date(proc) == ["train", "export", "benchmark"]


def test_going_back_to_earlier_params_restores_instead_of_recomputing(repo):
    """DVC's run cache keeps every run of the stages after hidden (whose out persists for
    resuming): back on the first run's lr, train, export and benchmark come back from it, and
    forward again, the second run's. A stage with an uncached out that is neither a metric nor
    a plot is never saved there (dvc.yaml's train and benchmark were, retraining every time)."""
    for lr in (SMALL["train"]["lr"], 2e-3):
        set_params(repo, {"train": {"lr": lr}})
        proc = dvc("repro", cwd=repo)
        assert ran(proc) == [], proc.stdout
        assert brought_up_to_date(proc) == ["train", "export", "benchmark"]


def test_lock_check_catches_a_stale_lock(repo):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import REPO

    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    check = [str(REPO / ".ci" / "check-lock"), str(repo)]
    ok = subprocess.run(check, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    set_params(repo, {"train": {"lr": 1e-3}})
    stale = subprocess.run(check, env=env, capture_output=True, text=True)
    assert stale.returncode == 1 and "train" in stale.stdout and "dvc.lock is stale" in stale.stderr
    set_params(repo, {"train": {"lr": 2e-3}})


def test_plots_render_without_network(repo, tmp_path):
    dvc("plots", "show", "-o", str(tmp_path / "plots"), cwd=repo)
    html = (tmp_path / "plots" / "index.html").read_text()
    assert "acceptance.png" in html and "train.png" in html
    assert "<script" not in html  # image plots only: nothing to fetch from a CDN


def test_metrics_and_params_diff_between_commits(repo):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    import subprocess

    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "run 1"], cwd=repo, check=True)
    set_params(repo, {"benchmark": {"num_speculative_tokens": 2}})
    dvc("repro", cwd=repo)
    diff = dvc("metrics", "diff", "HEAD", "--json", cwd=repo).stdout
    assert json.loads(diff)["metrics/benchmark.json"]["k"] == {"old": 3, "new": 2, "diff": -1}
    pdiff = json.loads(dvc("params", "diff", "HEAD", "--json", cwd=repo).stdout)
    assert pdiff["params.yaml"]["benchmark.num_speculative_tokens"]["new"] == 2


def test_lock_records_every_artifact_hash(repo):
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    for stage in ALL:
        outs = lock["stages"][stage].get("outs", [])
        assert all(o.get("md5") for o in outs), (stage, outs)
        assert all(d.get("md5") for d in lock["stages"][stage]["deps"])
    assert "target" in lock["stages"]["target"]["params"]["params.yaml"]


def test_status_is_clean_and_outs_are_gitignored(repo):
    assert "up to date" in dvc("status", cwd=repo).stdout
    ignored = (repo / "models/.gitignore").read_text() + (repo / "data/.gitignore").read_text()
    assert "/target" in ignored and "/raw" in ignored and "/tokenized" in ignored


def test_a_drafter_to_finetune_is_a_dep_of_train(repo):
    """train.init: models/init fine-tunes the drafter there, and dvc.yaml tracks that folder:
    a changed drafter makes train stale (and only it, until its output changes). A path elsewhere is
    refused, since DVC would not see it change."""
    from draftsmith.config import ConfigError, load_config

    drafter = repo / "models" / "init" / "model.safetensors"
    drafter.write_bytes(b"a drafter")
    try:
        stale = dvc("status", "--json", cwd=repo).stdout
        assert set(json.loads(stale)) == {"train"}  # export and benchmark follow its output
    finally:
        drafter.unlink()
    assert "up to date" in dvc("status", cwd=repo).stdout
    with pytest.raises(ConfigError, match="(?s)not tracked by DVC.*models/init"):
        load_config(repo / "params.yaml", [f"train.init={repo / 'models'}"])
