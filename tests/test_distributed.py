"""torchrun on the CPU (gloo, world size 2): the hidden and train stages relaunch themselves
under torchrun when params ask for two processes, and give what one process gives."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from conftest import REPO
from draftsmith.atomic import write_json
from draftsmith.checkpoint import DRAFTER_WEIGHTS

pytestmark = pytest.mark.distributed


def _params(tmp_path: Path, name: str, nproc: int, **sections) -> Path:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["distributed"]["nproc_per_node"] = nproc
    for section, values in sections.items():
        params[section].update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def _stage(stage: str, params: Path, **paths) -> subprocess.Popen:
    args = [f"--{k}={v}" for k, v in paths.items()]
    # One thread a process in every run, so one process and two compute alike.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", f"stages.{stage}", "--params", str(params),
                             *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _ok(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[:3000] + "\n...\n" + err[-3000:]


def random_tokenized(tok: Path, samples: int, vocab_size: int, ids_below: int) -> Path:
    """A tokenized artifact of random samples of 20-59 tokens (the hidden stage reads only ids)."""
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(20, 60, (samples,), generator=g)]
    tok.mkdir(exist_ok=True)
    ids = torch.randint(3, ids_below, (sum(lengths),), generator=g).to(torch.int32)
    save_file({"input_ids": ids,
               "loss_mask": torch.ones(sum(lengths), dtype=torch.uint8),
               "cu_seqlens": torch.cumsum(torch.tensor([0, *lengths]), 0)},
              tok / "shard-00000.safetensors")
    write_json(tok / "manifest.json", {"vocab_size": vocab_size, "shards": [
        {"file": "shard-00000.safetensors", "ids": [f"{i:08x}" for i in range(samples)]}]})
    return tok


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> Path:
    return random_tokenized(tmp_path_factory.mktemp("tok"), 300, 512, ids_below=500)


HIDDEN = dict(shard_mb=0.05, row_tokens=256, dtype="float32")  # ~60 small shards


@pytest.fixture(scope="module")
def one_process(toy_target, tokenized, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("h1")
    _ok(_stage("hidden", _params(tmp, "p", 1, hidden=HIDDEN), target=toy_target,
               tokenized=tokenized, out=tmp / "h", work=tmp / "h.work", metrics=tmp / "m.json"))
    return tmp / "h"


def _same_artifact(a: Path, b: Path) -> None:
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert ma == mb  # same shards, same samples in the same order, same sha256
    assert len(ma["shards"]) > 10
    for shard in ma["shards"]:
        assert (a / shard["file"]).read_bytes() == (b / shard["file"]).read_bytes()


def _alive(pid: int) -> bool:
    """Running (a zombie is dead: only its exit status waits for a reaper)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_rank_killed_mid_run_loses_no_finished_shard(toy_target, tokenized, one_process,
                                                     tmp_path, fault_row):
    """Two processes give one process's artifact, file for file (bitwise on the CPU). SIGKILL
    one of the two workers once shards are being written: torchrun stops the run, no process
    is left, and the rerun keeps every finished shard and ends equal to one process."""
    params = _params(tmp_path, "p", 2, hidden=HIDDEN)
    proc = _stage("hidden", params, target=toy_target, tokenized=tokenized,
                  out=tmp_path / "h", work=tmp_path / "h.work")
    deadline = time.time() + 300
    while len(list((tmp_path / "h").glob("hidden-*.safetensors"))) < 6:
        assert proc.poll() is None and time.time() < deadline, "the stage ended too early"
        time.sleep(0.05)
    workers = _children(proc.pid)  # the stage's pid is torchrun's (it execs itself)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert not (tmp_path / "h" / "manifest.json").exists()
    assert not any(_alive(p) for p in workers)  # the other rank is gone too
    finished = {f.name: f.read_bytes() for f in (tmp_path / "h").glob("hidden-*.safetensors")}
    _ok(_stage("hidden", params, target=toy_target, tokenized=tokenized, out=tmp_path / "h",
               work=tmp_path / "h.work", metrics=tmp_path / "m.json"))
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["processes"] == 2 and metrics["reused_shards"] == len(finished)
    for name, data in finished.items():  # kept as they were, not redone
        assert (tmp_path / "h" / name).read_bytes() == data
    assert not list((tmp_path / "h").glob(".*.tmp"))
    _same_artifact(one_process, tmp_path / "h")
    fault_row("one of two hidden-stage processes SIGKILLed (torchrun)", f"torchrun stops the "
              f"run, no process left; the rerun keeps the {len(finished)} finished shards and "
              "ends equal to one uninterrupted process")


TRAIN = dict(steps=60, batch_size=4, seq_len=256, ttt_steps=3, log_every=1, save_every=10,
             eval_samples=16, num_workers=0, warmup_steps=5, lr=3e-3)


@pytest.fixture(scope="module")
def inputs(toy_target, tokenized, one_process, tmp_path_factory) -> dict:
    from draftsmith import vocab
    from draftsmith.config import VocabConfig

    d = tmp_path_factory.mktemp("vocab")
    vocab.run(VocabConfig(draft_vocab_size=128), tokenized, 512, d / "vocab")
    return dict(target=toy_target, tokenized=tokenized, hidden=one_process, vocab=d / "vocab")


def _train(tmp: Path, inputs: dict, nproc: int, parallel: str = "ddp") -> subprocess.Popen:
    return _stage("train", _params(tmp, f"train{nproc}", nproc,
                                   train=dict(TRAIN, parallel=parallel)), **inputs,
                  out=tmp / "drafter", checkpoints=tmp / "ckpt", work=tmp / "train.work",
                  curve=tmp / "curve.csv", plot=tmp / "curve.png", metrics=tmp / "m.json")


def _curve(path: Path) -> dict[int, list[float]]:
    lines = path.read_text().splitlines()
    return {int(r.split(",")[0]): [float(x) for x in r.split(",")[1:]] for r in lines[1:]}


@pytest.fixture(scope="module")
def trained_one(inputs, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("t1")
    _ok(_train(tmp, inputs, 1))
    return tmp


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_training_on_two_processes_follows_the_one_process_curve(inputs, trained_one, tmp_path,
                                                                 parallel):
    """The same global batch split over two processes, the drafter replicated (DDP) or its
    weights, gradients and AdamW state sharded (FSDP2): the same loss and accuracy at every
    step (fp32 sums in another order: 1e-4), and the same drafter."""
    _ok(_train(tmp_path, inputs, 2, parallel))
    one, two = _curve(trained_one / "curve.csv"), _curve(tmp_path / "curve.csv")
    assert sorted(one) == sorted(two) == list(range(TRAIN["steps"]))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4, abs=1e-4), step
    assert one[0][0] - one[TRAIN["steps"] - 1][0] > 0.5  # it learned: the curve says something
    a = load_file(trained_one / "drafter" / DRAFTER_WEIGHTS)
    b = load_file(tmp_path / "drafter" / DRAFTER_WEIGHTS)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)
    m1, m2 = (json.loads((d / "m.json").read_text()) for d in (trained_one, tmp_path))
    assert (m1["processes"], m2["processes"]) == (1, 2)
    assert m2["eval_accuracy"] == pytest.approx(m1["eval_accuracy"], abs=1e-3)


def test_checkpoint_of_two_processes_resumes_on_one(inputs, trained_one, tmp_path, fault_row):
    """Killed after a checkpoint written by a two-process FSDP2 run (each process holding half
    the weights and optimizer state), resumed by one process: the same drafter as one
    uninterrupted process's."""
    proc = _train(tmp_path, inputs, 2, "fsdp")
    deadline = time.time() + 300
    while not (tmp_path / "ckpt" / "state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "no checkpoint before the end"
        time.sleep(0.02)
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)  # torchrun itself: its workers die with it
    proc.wait()
    time.sleep(1)
    assert not any(_alive(p) for p in workers), "a worker outlived torchrun"
    assert not (tmp_path / "drafter").exists()
    _ok(_train(tmp_path, inputs, 1))
    m = json.loads((tmp_path / "m.json").read_text())
    assert 0 < m["resumed_from_step"] < TRAIN["steps"]
    a = load_file(trained_one / "drafter" / DRAFTER_WEIGHTS)
    b = load_file(tmp_path / "drafter" / DRAFTER_WEIGHTS)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)
    fault_row("train stage SIGKILLed mid-run (two processes, FSDP2)", "no drafter written, no process "
              f"left; resumed from step {m['resumed_from_step']} by one process, ending with "
              "the uninterrupted run's drafter")


def test_online_training_on_two_processes_follows_one(inputs, tmp_path):
    """hidden.mode: online under torchrun: each process runs the target on its own rows."""
    from draftsmith.hidden import write_online_manifest

    online = dict(inputs, hidden=tmp_path / "online")
    write_online_manifest([1, 3, 4], 64, online["hidden"])
    short = dict(TRAIN, steps=6, save_every=0)
    curves = {}
    for n in (1, 2):
        tmp = tmp_path / f"p{n}"
        _ok(_stage("train", _params(tmp_path, f"online{n}", n, train=short,
                                    hidden={"mode": "online"}), **online,
                   out=tmp / "drafter", checkpoints=tmp / "ckpt", work=tmp / "train.work",
                   curve=tmp / "curve.csv", plot=tmp / "curve.png", metrics=tmp / "m.json"))
        curves[n] = _curve(tmp / "curve.csv")
        assert json.loads((tmp / "m.json").read_text())["hidden_mode"] == "online"
    for step in curves[1]:
        assert curves[2][step] == pytest.approx(curves[1][step], rel=1e-4, abs=1e-4), step


def test_the_mla_drafter_on_two_processes_follows_one(deepseek_dir, tmp_path):
    """train.drafter_arch: mla (the target's latent attention, values narrower than keys) under
    FSDP2 over two processes: the one-process curve and drafter, as the Llama layer's."""
    from draftsmith import vocab
    from draftsmith.config import TargetConfig, VocabConfig
    from draftsmith.target import resolve
    from draftsmith.target_info import read_info

    resolve(TargetConfig(model=str(deepseek_dir)), tmp_path / "target")
    V = read_info(tmp_path / "target").vocab_size
    tok = random_tokenized(tmp_path / "tok", 120, V, ids_below=V)
    _ok(_stage("hidden", _params(tmp_path, "h", 1, hidden=HIDDEN), target=tmp_path / "target",
               tokenized=tok, out=tmp_path / "h", work=tmp_path / "h.work",
               metrics=tmp_path / "h.json"))
    vocab.run(VocabConfig(draft_vocab_size=128), tok, V, tmp_path / "vocab")
    mla = dict(TRAIN, steps=20, drafter_arch="mla", parallel="fsdp")
    runs = {}
    for n in (1, 2):
        d = tmp_path / f"p{n}"
        _ok(_stage("train", _params(tmp_path, f"mla{n}", n, train=mla), target=tmp_path / "target",
                   tokenized=tok, hidden=tmp_path / "h", vocab=tmp_path / "vocab",
                   out=d / "drafter", checkpoints=d / "ckpt", work=d / "train.work",
                   curve=d / "curve.csv", plot=d / "curve.png", metrics=d / "m.json"))
        runs[n] = d
        assert json.loads((d / "m.json").read_text())["processes"] == n
    one, two = _curve(runs[1] / "curve.csv"), _curve(runs[2] / "curve.csv")
    assert sorted(one) == sorted(two) == list(range(mla["steps"]))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4, abs=1e-4), step
    a = load_file(runs[1] / "drafter" / DRAFTER_WEIGHTS)
    b = load_file(runs[2] / "drafter" / DRAFTER_WEIGHTS)
    assert "midlayer.self_attn.kv_b_proj.weight" in a  # the MLA layer it trained
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("parallel, cases", [("ddp", ["train", "hidden"]), ("fsdp", ["train"])])
def test_scale_out_benchmark_runs_on_the_cpu(tmp_path, parallel, cases):
    """benchmarks/scale_out.py keeps working between multi-GPU runs: toy preset, gloo."""
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale_out.py"), "--preset",
                    "toy", "--device", "cpu", "--nproc", "1", "2", "--parallel", parallel,
                    "--cases", *cases, "--json", str(out)],
                   check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    results = json.loads(out.read_text())["results"]
    assert [r["processes"] for r in results] == [1, 2]
    for case in cases:
        assert all(r[case]["tokens_per_s"] > 0 for r in results)
        assert results[0][case]["speedup"] == 1.0 and results[1][case]["speedup"] > 0
    assert results[1]["train"]["parallel"] == parallel


def test_multi_node_command_line():
    from draftsmith.config import ConfigError, DistributedConfig, load_config
    from draftsmith.dist import torchrun_argv

    assert torchrun_argv(DistributedConfig(), "stages.hidden", []) is None  # one process
    local = torchrun_argv(DistributedConfig(nproc_per_node=8), "stages.train", ["--out=x"])
    assert local[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=1",
                         "--standalone", "-m", "stages.train", "--out=x"]
    node = torchrun_argv(DistributedConfig(nproc_per_node=8, nnodes=2, node_rank=1,
                                           rdzv_endpoint="head:29500"), "stages.hidden", [])
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29500",
            "--rdzv-id=draftsmith"} <= set(node) and "--standalone" not in node
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        load_config(REPO / "params.yaml", ["distributed.nnodes=2"])


def test_world_size_checks_before_work(toy_target, tokenized, tmp_path, monkeypatch):
    from draftsmith import dist, hidden
    from draftsmith.config import HiddenConfig
    from draftsmith.errors import DraftsmithError

    two = dist.World(rank=0, size=2)
    with pytest.raises(DraftsmithError, match="multiple of the world size"):
        dist.check_divides(3, two)
    monkeypatch.setattr(dist, "world", lambda: two)
    with pytest.raises(DraftsmithError, match="nproc_per_node: 1"):
        hidden.run(HiddenConfig(device_map="auto"), toy_target, tokenized, tmp_path / "h")
    assert not (tmp_path / "h").exists()
