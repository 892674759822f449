"""End to end through DVC itself: a fresh checkout, `dvc repro` on small params, then the
caching behaviour users rely on."""

import json

import pytest
import yaml

from conftest import TINY_TARGET, copy_repo, dvc

pytestmark = pytest.mark.e2e

SMALL = {
    "target": {"embedded": TINY_TARGET},
    "generate": {"num_samples": 16, "max_new_tokens": 96, "batch_size": 8},
}


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


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = copy_repo(tmp_path_factory.mktemp("clone"))
    set_params(repo, SMALL)
    first = dvc("repro", "tokenize", cwd=repo)
    assert ran(first) == ["target", "generate", "tokenize"]
    return repo


def test_metrics_of_the_first_stages(repo):
    gen = json.loads((repo / "metrics/generate.json").read_text())
    assert gen["samples"] == 16 and gen["errors"] == 0
    tok = json.loads((repo / "metrics/tokenize.json").read_text())
    assert tok["format_check_pass_rate"] == 1.0 and tok["samples_kept"] > 0
    target = json.loads((repo / "metrics/target.json").read_text())
    assert target["kind"] == "embedded" and target["heldout_loss"] < 3.0


def test_second_repro_reruns_nothing(repo):
    again = dvc("repro", "tokenize", cwd=repo)
    assert ran(again) == []
    assert "didn't change, skipping" in again.stdout


def test_tokenize_param_reruns_only_tokenize(repo):
    set_params(repo, {"tokenize": {"max_length": 400}})
    assert ran(dvc("repro", "tokenize", cwd=repo)) == ["tokenize"]


def test_lock_records_every_artifact_hash(repo):
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    for stage in ("target", "generate", "tokenize"):
        outs = lock["stages"][stage]["outs"]
        assert all(o.get("md5") for o in outs), (stage, outs)
        assert all(d.get("md5") for d in lock["stages"][stage]["deps"])
    assert "target" in lock["stages"]["target"]["params"]["params.yaml"]


def test_status_is_clean_and_outs_are_gitignored(repo):
    assert "up to date" in dvc("status", cwd=repo).stdout
    ignored = (repo / "models/.gitignore").read_text() + (repo / "data/.gitignore").read_text()
    assert "/target" in ignored and "/raw" in ignored and "/tokenized" in ignored
