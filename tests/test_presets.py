"""Presets (presets/*.yaml) written into params.yaml by `draftsmith config preset`: values change
in place, every comment and other line stays, the result is validated before it replaces
params.yaml; and the helper that runs dvc.yaml's stages where DVC is not installed."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from draftsmith.config import load_config
from draftsmith.errors import ConfigError
from draftsmith.presets import apply

PRESETS = sorted((REPO / "presets").glob("*.yaml"))


def cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "draftsmith.cli", *args], cwd=cwd,
                          capture_output=True, text=True)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_each_shipped_preset_applies_to_params_yaml_and_changes_only_its_lines(preset, tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", params)
    p = cli("config", "preset", str(preset), "-p", str(params))
    assert p.returncode == 0, p.stderr
    before, after = (REPO / "params.yaml").read_text().splitlines(), params.read_text().splitlines()
    assert len(before) == len(after)
    changed = [(b, a) for b, a in zip(before, after) if b != a]
    want = yaml.safe_load(preset.read_text())
    flat = {f"{s}.{k}": v for s, sec in want.items() for k, v in sec.items()
            if not isinstance(v, dict)}
    flat |= {f"{s}.{k}.{kk}": vv for s, sec in want.items() for k, v in sec.items()
             if isinstance(v, dict) for kk, vv in v.items()}
    assert p.stdout.count(",") + 1 == len(flat)
    # each key the preset sets is a line that changed or already held the value
    assert 0 < len(changed) <= len(flat)
    for b, a in changed:  # the comment after the value survives
        assert "#" not in b or b[b.index("  #"):].strip() == a[a.index("  #"):].strip()
    cfg = load_config(params).model_dump()
    for key, value in flat.items():
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert node == value, key


def test_a_preset_key_params_yaml_lacks_is_named_and_nothing_is_written(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", params)
    text = params.read_text()
    (tmp_path / "bad.yaml").write_text("train:\n  stpes: 10\n")
    p = cli("config", "preset", str(tmp_path / "bad.yaml"), "-p", str(params))
    assert p.returncode == 2 and "train.stpes" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "bad.yaml").write_text("train:\n  steps: -3\n")  # a key that exists, a bad value
    p = cli("config", "preset", str(tmp_path / "bad.yaml"), "-p", str(params))
    assert p.returncode == 2 and "steps" in p.stderr
    assert params.read_text() == text and sorted(x.name for x in tmp_path.iterdir()) == \
        ["bad.yaml", "params.yaml"]  # no trial file left behind


def test_values_of_every_kind_render_as_yaml_that_reads_back():
    text = "a:\n  s: x  # c\n  l: [1]\n  m: {}\n  n: null\n  sub:\n    f: 1.0\n"
    preset = {"a": {"s": "vllm serve {model} --x 1", "l": ["reference", "vllm"],
                    "m": {"draft_sample_method": "probabilistic"}, "n": "#not a comment",
                    "sub": {"f": 5e-4}}}
    out, keys = apply(text, preset)
    assert yaml.safe_load(out) == preset and "  # c" in out
    assert keys == ["a.l", "a.m", "a.n", "a.s", "a.sub.f"]
    with pytest.raises(ConfigError, match="a.sub.g"):
        apply(text, {"a": {"sub": {"g": 1}}})


def test_run_stages_runs_dvc_yaml_in_order_times_each_and_stops_at_a_failure(tmp_path):
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "one": {"cmd": "echo 1 > one.txt"}, "two": {"cmd": "exit 3"},
        "three": {"cmd": "echo 3 > three.txt"}}}, sort_keys=False))
    times = tmp_path / "times.json"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks/run_stages.py"), "--repo",
                        str(tmp_path), "--json", str(times)], capture_output=True, text=True)
    assert p.returncode == 3
    t = json.loads(times.read_text())
    assert list(t) == ["one", "two"] and t["one"]["rc"] == 0 and t["two"]["rc"] == 3
    assert (tmp_path / "one.txt").exists() and not (tmp_path / "three.txt").exists()
    p = subprocess.run([sys.executable, str(REPO / "benchmarks/run_stages.py"), "--repo",
                        str(tmp_path), "--json", str(times), "three"], capture_output=True,
                       text=True)
    assert p.returncode == 0 and list(json.loads(times.read_text())) == ["one", "two", "three"]
