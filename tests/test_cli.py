import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO


def cli(*args):
    return subprocess.run([sys.executable, "-m", "draftsmith.cli", *args], cwd=REPO,
                          capture_output=True, text=True)


def test_config_show_resolves_overrides():
    p = cli("config", "show", "generate", "-s", "generate.temperature=0.6")
    assert p.returncode == 0, p.stderr
    assert "temperature: 0.6" in p.stdout and "target:" not in p.stdout


def test_config_check_reports_bad_key_without_traceback(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("generate:\n  num_sampels: 3\n")
    p = cli("config", "check", "-p", str(bad))
    assert p.returncode == 2
    assert "num_sampels: unknown key (did you mean 'num_samples'?)" in p.stderr
    assert "Traceback" not in p.stderr


def test_validate_names_a_missing_export(tmp_path):
    p = cli("validate", str(tmp_path / "nope"), "--target", str(tmp_path))
    assert p.returncode == 2 and "fix:" in p.stderr


def _base_python():
    """The interpreter this venv was made from: what a fresh shell's `python` runs, without
    the library (the stages' own `python` when dvc is run from outside `make`)."""
    base = os.path.join(sys.base_prefix, "bin", "python3")
    has = subprocess.run([base, "-c", "import importlib.util as u, sys; "
                                      "sys.exit(u.find_spec('draftsmith') is None)"])
    if has.returncode == 0:
        pytest.skip(f"{base} has draftsmith installed: no fresh-shell interpreter to try")
    return base


def test_every_stage_command_names_an_interpreter_a_fresh_shell_has():
    """dvc.yaml's commands run from the user's shell: `python` is missing on a stock Debian or
    Ubuntu (python3 only), where `dvc repro` would end in `python: not found` (exit 127)."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        interpreter, *args = stage["cmd"].split()
        assert args[:2] == ["-m", f"stages.{name}"], name
        assert shutil.which(interpreter, path="/usr/bin:/bin"), \
            f"{name}: {interpreter} is not on a fresh shell's PATH"


def test_a_stage_run_by_a_python_without_the_library_moves_into_the_checkouts_venv():
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv in this checkout (`make install` makes it)")
    p = subprocess.run([_base_python(), "-m", "stages.vocab", "--help"], cwd=REPO,
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    assert "usage: stages.vocab" in p.stdout
    assert "has no draftsmith installed; running this stage with" in p.stderr


def test_a_stage_with_neither_the_library_nor_a_venv_names_the_fix(tmp_path):
    shutil.copytree(REPO / "stages", tmp_path / "stages")  # a checkout before `make install`
    p = subprocess.run([_base_python(), "-m", "stages.vocab", "--help"], cwd=tmp_path,
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 1
    assert "has no draftsmith installed. Run `make install`" in p.stderr
    assert "Traceback" not in p.stderr and "usage:" not in p.stdout


def test_metrics_prints_one_line_a_stage_from_what_the_pipeline_wrote():
    p = cli("metrics")  # the committed metrics/ of the embedded default
    assert p.returncode == 0, p.stderr
    rows = p.stdout.splitlines()
    stages = ["target", "generate", "tokenize", "vocab", "hidden", "train", "export", "benchmark"]
    assert [r.split()[0] for r in rows[1:9]] == stages
    assert "not run yet" not in p.stdout and "unreadable" not in p.stdout
    assert max(len(r) for r in rows) < 200  # a line a stage, not `dvc metrics show`'s columns
    benchmark = json.loads((REPO / "metrics/benchmark.json").read_text())
    assert (f"acceptance length {benchmark['acceptance_length']} +- "
            f"{benchmark['acceptance_length_se']} at k=") in rows[8]  # with its error over prompts


def test_metrics_says_which_stages_have_not_run_and_which_it_cannot_read(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps(
        {"draft_vocab_size": 8, "target_vocab_size": 20, "coverage": 0.9, "wall_s": 1.5}))
    (tmp_path / "train.json").write_text("[1, 2]")  # not a stage's metrics
    p = cli("metrics", str(tmp_path))
    assert p.returncode == 0, p.stderr
    line = {r.split()[0]: r for r in p.stdout.splitlines()[1:9]}
    assert "8 of 20 tokens cover 90.00%" in line["vocab"] and "1.5" in line["vocab"]
    assert "unreadable" in line["train"] and "Traceback" not in p.stderr
    assert all("not run yet" in line[s] for s in ("target", "hidden", "benchmark"))
    missing = cli("metrics", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "run the pipeline first" in missing.stderr
