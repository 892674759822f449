import os
import shutil
import subprocess
import sys

import pytest

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
