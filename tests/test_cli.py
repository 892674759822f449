import subprocess
import sys

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
