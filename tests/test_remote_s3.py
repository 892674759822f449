"""The shared artifact cache, for real: a SeaweedFS S3 server on 127.0.0.1, `dvc push` from a
run, `dvc pull` / `dvc repro --pull` in a fresh clone."""

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import copy_repo, dvc
from test_pipeline_dvc import ALL, SMALL, ran, set_params

pytestmark = pytest.mark.e2e
KEY, SECRET, BUCKET = "draftsmith", "draftsmith-secret", "draftsmith"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 server (SeaweedFS `weed mini`), loopback only, telemetry off; stopped by PID."""
    root = tmp_path_factory.mktemp("s3")
    (root / "s3.json").write_text(json.dumps({"identities": [{
        "name": "ci", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
        "actions": ["Admin", "Read", "Write", "List"]}]}))
    (root / "data").mkdir()
    (root / "logs").mkdir()
    port = _free_port()
    ports = {f"-{k}": _free_port() for k in ("master.port", "volume.port", "filer.port",
                                             "admin.port")}
    weed = Path(sys.executable).parent / "weed"
    proc = subprocess.Popen(
        [str(weed), f"-logdir={root / 'logs'}", "mini", f"-dir={root / 'data'}",
         "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false", "-admin.ui=false",
         "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.port={port}",
         *[f"{k}={v}" for k, v in ports.items()],
         f"-s3.config={root / 's3.json'}", f"-bucket={BUCKET}"],
        stdout=open(root / "out.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError((root / "out.log").read_text()[-2000:])
    time.sleep(2)  # the bucket is created just after the port opens
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


def use_remote(repo, endpoint, secret=SECRET, default=True):
    if default:
        dvc("remote", "add", "-f", "-d", "storage", f"s3://{BUCKET}/cache", cwd=repo)
    dvc("remote", "modify", "storage", "endpointurl", endpoint, cwd=repo)
    dvc("remote", "modify", "--local", "storage", "access_key_id", KEY, cwd=repo)
    dvc("remote", "modify", "--local", "storage", "secret_access_key", secret, cwd=repo)


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


@pytest.fixture(scope="module")
def pushed(s3, tmp_path_factory):
    """A small run, committed and pushed. The committed config names the remote; the
    credentials stay in .dvc/config.local (never committed)."""
    repo = copy_repo(tmp_path_factory.mktemp("origin"))
    set_params(repo, SMALL)
    use_remote(repo, s3)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "remote")
    assert ran(dvc("repro", cwd=repo)) == ALL
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "run")
    assert "config.local" not in subprocess.run(["git", "ls-files"], cwd=repo, text=True,
                                                capture_output=True).stdout
    return repo


def fresh_clone(origin, dest, endpoint, secret=SECRET):
    subprocess.run(["git", "clone", "-q", str(origin), str(dest)], check=True)
    use_remote(dest, endpoint, secret, default=False)
    return dest


def test_push_then_pull_in_a_fresh_clone_reruns_nothing(s3, pushed, tmp_path):
    dvc("push", cwd=pushed)
    clone = fresh_clone(pushed, tmp_path / "clone", s3)
    dvc("pull", cwd=clone)
    again = dvc("repro", cwd=clone)
    assert ran(again) == [] and "Data and pipelines are up to date." in again.stdout
    diff = json.loads(dvc("metrics", "diff", "HEAD~1", "--json", cwd=clone).stdout)
    assert "metrics/benchmark.json" in diff


def test_repro_pull_with_an_empty_cache(s3, pushed, tmp_path):
    dvc("push", cwd=pushed)
    clone = fresh_clone(pushed, tmp_path / "clone", s3)
    shutil.rmtree(clone / ".dvc" / "cache", ignore_errors=True)
    assert ran(dvc("repro", "--pull", cwd=clone)) == []
    assert (clone / "models" / "export" / "vllm" / "model.safetensors").exists()


def test_wrong_credentials_fail_clearly_and_touch_nothing(s3, pushed, tmp_path):
    dvc("push", cwd=pushed)
    clone = fresh_clone(pushed, tmp_path / "clone", s3, secret="wrong")
    before = sorted(p.relative_to(clone) for p in clone.rglob("*") if ".git" not in p.parts)
    proc = dvc("pull", cwd=clone, check=False)
    assert proc.returncode != 0 and "Forbidden" in proc.stderr + proc.stdout
    after = sorted(p.relative_to(clone) for p in clone.rglob("*") if ".git" not in p.parts
                   and ".dvc" not in p.parts)
    assert not (clone / "data" / "raw").exists() and not (clone / "models" / "target").exists()
    assert set(after) <= set(before)


def test_missing_objects_are_reported_and_only_their_stages_recompute(s3, tmp_path_factory,
                                                                      tmp_path):
    # A second origin whose push covers only the stages up to tokenize.
    repo = copy_repo(tmp_path_factory.mktemp("partial"))
    set_params(repo, SMALL)
    dvc("remote", "add", "-f", "-d", "storage", f"s3://{BUCKET}/partial", cwd=repo)
    use_remote(repo, s3, default=False)
    dvc("repro", cwd=repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "run")
    dvc("push", "target", "generate", "tokenize", cwd=repo)
    clone = fresh_clone(repo, tmp_path / "clone", s3)
    pull = dvc("pull", cwd=clone, check=False)
    assert pull.returncode != 0
    text = pull.stdout + pull.stderr
    assert "failed to pull data from the cloud" in text, text
    # Exactly the pushed stages' artifacts arrived; the others are reported missing.
    for path in ("models/target", "data/raw", "data/tokenized"):
        assert (clone / path).exists(), path
    for path in ("data/vocab", "data/hidden", "models/drafter", "models/export"):
        assert not (clone / path).exists(), path
    assert "data/hidden" in dvc("status", cwd=clone).stdout  # DVC names what is missing
    assert ran(dvc("repro", cwd=clone)) == ["vocab", "hidden", "train", "export"]
