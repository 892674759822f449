"""The fault suite: inject a failure, check what a user gets (retry and resume, or a clear error
naming the cause and the fix), that no sample is lost or duplicated and no half-written artifact
is left. Each passing test adds a row to metrics/faults.json (see conftest.fault_row).

The generation server here is a real HTTP server on 127.0.0.1 speaking the OpenAI chat API,
answering each prompt deterministically from its id, and misbehaving on the requests a plan picks.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from draftsmith import generate, tokenization
from draftsmith.config import ConfigError, GenerateConfig, ServerConfig, TokenizeConfig, load_config
from draftsmith.errors import DraftsmithError

pytestmark = pytest.mark.faults
N = 12  # prompts per generate run


class FaultServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, plan, port: int = 0):
        """plan(n, attempt) -> what the n-th completion request (0-based) gets, `attempt` being
        how many times its sample was asked before: ok, 500, 429, hang, malformed, cut (half a
        body), no_reasoning."""
        super().__init__(("127.0.0.1", port), Handler)
        self.plan, self.count, self.lock = plan, 0, threading.Lock()
        self.attempts: dict[int, int] = {}
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, json.dumps({"data": [{"id": "toy"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = body["seed"]  # one per sample (generate derives it from the sample id)
        with self.server.lock:
            n = self.server.count
            self.server.count += 1
            attempt = self.server.attempts.get(key, 0)
            self.server.attempts[key] = attempt + 1
        what = self.server.plan(n, attempt)
        # As a server's reasoning parser returns them: tags dropped, whitespace kept.
        message = {"role": "assistant", "content": f"\n\nanswer {key}",
                   "reasoning_content": f"\nthinking about {key}\n"}
        if what == "no_reasoning":
            del message["reasoning_content"]
        ok = json.dumps({"choices": [{"message": message, "finish_reason": "stop"}],
                         "usage": {"completion_tokens": 6}}).encode()
        if what in ("500", "429"):
            self._send(int(what), b'{"error": "injected"}')
        elif what == "hang":
            time.sleep(2.0)  # past the client's timeout
            self._send(200, ok)
        elif what == "malformed":
            self._send(200, b'{"choices": [{"message": ')
        elif what == "cut":  # the connection drops half way through the body
            self.send_response(200)
            self.send_header("Content-Length", str(len(ok)))
            self.end_headers()
            self.wfile.write(ok[: len(ok) // 2])
            self.wfile.flush()
            self.connection.close()
        else:
            self._send(200, ok)


def _server_cfg(url: str, **kw) -> ServerConfig:
    return ServerConfig(urls=[url], api_key_env=None, concurrency=3, request_timeout_s=1.0,
                        max_retries=4, backoff_s=0.01, **kw)


def _generate(toy_target, out: Path, url: str, **kw):
    cfg = GenerateConfig(num_samples=N, backend="openai", max_new_tokens=16)
    return generate.run(cfg, toy_target, out / "raw", _server_cfg(url, **kw), out / "work")


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "raw" / "samples.jsonl").read_text().splitlines()]


def _check_complete(out: Path) -> None:
    """Every prompt exactly once, each answer its own (no mixing between samples)."""
    records = _records(out)
    ids = [r["id"] for r in records]
    assert len(records) == N and len(set(ids)) == N
    for r in records:
        key = r["content"].split()[-1]
        assert r["content"] == f"answer {key}" and r["reasoning"] == f"thinking about {key}"
    assert not list((out / "raw").glob(".*.tmp*"))


# Each fault hits a sample's first one or two attempts, for some samples.
@pytest.mark.parametrize("fault, plan", [
    ("500", lambda n, a: "500" if a < 2 and n % 3 == 0 else "ok"),
    ("429", lambda n, a: "429" if a < 2 and n % 2 == 0 else "ok"),
    ("hang", lambda n, a: "hang" if a == 0 and n in (1, 5) else "ok"),
    ("malformed", lambda n, a: "malformed" if a == 0 and n % 4 == 1 else "ok"),
    ("cut", lambda n, a: "cut" if a == 0 and n % 4 == 2 else "ok"),
])
def test_transient_server_faults_are_retried(toy_target, tmp_path, fault, plan, fault_row):
    server = FaultServer(plan)
    try:
        m = _generate(toy_target, tmp_path, server.url)
    finally:
        server.stop()
    _check_complete(tmp_path)
    assert m["samples"] == N and m["reasoning_capture_rate"] == 1.0
    assert server.count > N  # the faults really happened, and were retried
    names = {"500": "generation server answers HTTP 500", "429": "generation server answers "
             "HTTP 429", "hang": "generation server hangs past the request timeout",
             "malformed": "generation server returns malformed JSON",
             "cut": "generation server's response cut off mid-body"}
    fault_row(names[fault], f"retried with backoff; all {N} samples, each once")


def test_killed_server_run_resumes_without_loss(toy_target, tmp_path, fault_row):
    """The server dies after 5 answers: the stage fails naming the cause and the fix; the rerun
    against a restarted server asks only for the missing samples."""
    server = FaultServer(lambda n, _: "ok")
    port = server.server_address[1]
    stop_after = 5

    def plan(n, _):
        if n == stop_after:
            threading.Thread(target=server.stop).start()  # dies mid-run
            time.sleep(0.5)
        return "ok"

    server.plan = plan
    with pytest.raises(DraftsmithError, match="(?s)failed after .*rerunning the stage resumes"):
        _generate(toy_target, tmp_path, server.url)
    assert not (tmp_path / "raw" / "samples.jsonl").exists()  # no half artifact
    journal = (tmp_path / "work" / "journal.jsonl").read_text().splitlines()
    kept = len(journal) - 1  # a header line, then one line a finished sample
    assert kept >= stop_after - 3  # what finished before the death is kept
    again = FaultServer(lambda n, _: "ok", port=port)
    try:
        m = _generate(toy_target, tmp_path, again.url)
    finally:
        again.stop()
    assert m["resumed_samples"] == kept and again.count == N - kept
    _check_complete(tmp_path)
    fault_row("generation server killed mid-run", "stage fails naming the fix; the rerun resumes "
              f"from the journal ({kept} kept, {N - kept} asked again), each sample once")


def test_missing_reasoning_field_is_caught_before_tokenized_data(toy_target, tmp_path,
                                                                   fault_row):
    """The seed's lost 5-hour run: answers without their reasoning. Generate measures it
    (capture rate, malformed share) and tokenize refuses, naming the problem and the fix."""
    server = FaultServer(lambda n, _: "no_reasoning" if n % 2 else "ok")  # n: unique, 0..11
    try:
        m = _generate(toy_target, tmp_path, server.url)
    finally:
        server.stop()
    assert m["samples"] == N and m["malformed_share"] == 0.5
    with pytest.raises(DraftsmithError, match="(?s)6 of 12 finished samples.*reasoning parser"):
        tokenization.run(TokenizeConfig(), toy_target, tmp_path / "raw", tmp_path / "tok")
    assert not (tmp_path / "tok").exists()
    fault_row("responses without the reasoning field", "generate reports malformed_share 0.5; "
              "tokenize refuses before writing, naming the fix")


@pytest.mark.parametrize("fault, edit, needle", [
    ("params: unknown key", {"train": {"stpes": 3}}, "stpes.*steps"),
    ("params: wrong type", {"train": {"steps": "many"}}, "train.steps"),
    ("params: inconsistent values", {"hidden": {"aux_layers": [2, 2, 5]}}, "aux_layers"),
])
def test_bad_params_fail_before_work(tmp_path, fault, edit, needle, fault_row):
    from draftsmith.config import check_aux_layers

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in edit.items():
        params[section].update(values)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError, match=f"(?s){needle}"):
        cfg = load_config(path, [])
        check_aux_layers(cfg.hidden, 8)  # what the hidden stage checks before loading anything
    fault_row(fault, "refused before any work, naming the key and the fix")


def test_sigkilled_hidden_stage_resumes_to_the_same_artifact(toy_target, tmp_path, fault_row):
    """SIGKILL in the middle of writing shards: no manifest (so no artifact) and no stray
    partial file survive the rerun, which reuses the finished shards; the result is the
    uninterrupted run's, sample for sample."""
    from safetensors.torch import save_file

    from draftsmith.atomic import write_json
    from draftsmith.hidden_format import iter_hidden

    import torch

    g = torch.Generator().manual_seed(0)
    n = 200
    lengths = [int(x) for x in torch.randint(20, 60, (n,), generator=g)]
    tok = tmp_path / "tok"
    tok.mkdir()
    save_file({"input_ids": torch.randint(3, 500, (sum(lengths),), generator=g).to(torch.int32),
               "loss_mask": torch.ones(sum(lengths), dtype=torch.uint8),
               "cu_seqlens": torch.cumsum(torch.tensor([0, *lengths]), 0)},
              tok / "shard-00000.safetensors")
    write_json(tok / "manifest.json", {"vocab_size": 512, "shards": [
        {"file": "shard-00000.safetensors", "ids": [f"{i:08x}" for i in range(n)]}]})
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["hidden"].update(shard_mb=0.025, row_tokens=256)  # ~100 small shards
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))

    def stage(out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "stages.hidden", "--params", str(tmp_path / "params.yaml"),
             "--target", str(toy_target), "--tokenized", str(tok), "--out", str(out),
             "--work", f"{out}.work"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    proc = stage(tmp_path / "h")
    deadline = time.time() + 120
    while len(list((tmp_path / "h").glob("hidden-*.safetensors"))) < 5:
        assert proc.poll() is None and time.time() < deadline, "the stage ended too early"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "h" / "manifest.json").exists()
    finished = len(list((tmp_path / "h").glob("hidden-*.safetensors")))
    assert stage(tmp_path / "h").wait() == 0
    assert stage(tmp_path / "ref").wait() == 0  # never interrupted
    assert not list((tmp_path / "h").glob(".*"))  # no partial shard left behind
    got = {sid: (a, f) for sid, a, f, _, _ in iter_hidden(tmp_path / "h")}
    ref = {sid: (a, f) for sid, a, f, _, _ in iter_hidden(tmp_path / "ref")}
    assert sorted(got) == sorted(ref) and len(got) == n  # none lost, none twice
    for sid in ref:
        assert torch.equal(got[sid][0], ref[sid][0]) and torch.equal(got[sid][1], ref[sid][1])
    reused = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert len(reused["shards"]) > finished
    fault_row("hidden stage SIGKILLed while writing shards", f"rerun reuses the {finished} "
              "finished shards; artifact equal to an uninterrupted run's")


@pytest.fixture
def small_disk(tmp_path):
    """A 192 KiB file system (tmpfs), resizable; skipped where mounting is not permitted."""
    where = tmp_path / "disk"
    where.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(where)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {mount.stderr.strip()}")
    yield where
    subprocess.run(["umount", "--lazy", str(where)], check=True)  # gone once nothing holds it


def test_full_disk_during_shard_writes(tmp_path, small_disk, fault_row):
    """The disk fills while hidden shards are written: a clear error naming the device and the
    fix, no partial shard left; with space again the rerun keeps the shards already written."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from draftsmith import hidden, hidden_format
    from draftsmith.config import HiddenConfig
    from test_hidden import _tokenized

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128)).eval()
    tok, _ = _tokenized(tmp_path, [40] * 60)  # 2,400 tokens x 512 bytes: 1.2 MB of states
    cfg = HiddenConfig(dtype="float32", shard_mb=0.04, row_tokens=64)  # ~40 KB shards
    out = small_disk / "hidden"
    with pytest.raises(DraftsmithError, match="(?s)no space left on the device.*free space"):
        hidden.write_hidden(cfg, model, [1, 3, 4], tok, out, "rev", 0)
    written = sorted(out.glob("hidden-*.safetensors"))
    assert written and not list(out.glob(".*.tmp")) and not (out / "manifest.json").exists()
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    m = hidden.write_hidden(cfg, model, [1, 3, 4], tok, out, "rev", 0)
    assert m["reused_shards"] == len(written) and m["samples"] == 60
    ref = hidden.write_hidden(cfg, model, [1, 3, 4], tok, tmp_path / "ref", "rev", 0)
    got = {sid: a for sid, a, *_ in hidden_format.iter_hidden(out)}
    assert got.keys() == {sid for sid, *_ in hidden_format.iter_hidden(tmp_path / "ref")}
    assert ref["tokens"] == m["tokens"]
    for sid, a, *_ in hidden_format.iter_hidden(tmp_path / "ref"):
        assert torch.equal(got[sid], a)
    fault_row("disk full while writing hidden shards", f"clear error naming the device; no "
              f"partial shard; the rerun with space keeps the {len(written)} written shards")


def test_tokenizer_without_chat_template_is_refused(toy_target, fault_row):
    from draftsmith.chat_probe import resolve_format
    from draftsmith.target_info import load_tokenizer

    tokenizer = load_tokenizer(toy_target)  # its own copy: the session's is shared
    tokenizer.chat_template = None  # a base model's tokenizer
    with pytest.raises(DraftsmithError, match="(?s)no chat template.*target.chat_format"):
        resolve_format("auto", tokenizer)
    fault_row("tokenizer without a chat template", "target refuses before any work, naming the "
              "fix (a chat model, or declare the format)")


def test_template_without_thinking_tokens_is_refused(toy_target, tmp_path, fault_row):
    """generate.thinking on for a target whose chat format has no reasoning: refused before
    any prompt is sent, instead of a data set without reasoning."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(toy_target, target, symlinks=True)
    info = json.loads((target / "target.json").read_text())
    (target / "target.json").write_text(json.dumps({**info, "chat_format": "chatml"}))
    with pytest.raises(DraftsmithError, match="(?s)has no reasoning.*generate.thinking: false"):
        generate.run(GenerateConfig(num_samples=N), target, tmp_path / "raw")
    assert not (tmp_path / "raw").exists()
    fault_row("chat format without thinking tokens, thinking on", "generate refuses before any "
              "request, naming both fixes")


def test_prompts_longer_than_the_context_fail_before_work(toy_target, tmp_path, fault_row):
    from draftsmith.target_info import context_length

    context = context_length(toy_target)
    source = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "What is 2 + 3?"}, {"prompt": " ".join(["7 + 8"] * context)}]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = GenerateConfig(source=str(source), num_samples=2, max_new_tokens=64)
    with pytest.raises(DraftsmithError, match=f"(?s)1 of 2 prompts do not fit the target's "
                       f"context of {context} tokens.*row 1.*remove or shorten"):
        generate.run(cfg, toy_target, tmp_path / "raw")
    assert not (tmp_path / "raw").exists()
    fault_row("prompt longer than the target's context", "generate refuses before any request, "
              "naming the row, its length and the fix")


@pytest.mark.parametrize("fault, lines, needle", [
    ("prompts file with invalid UTF-8", [b'{"prompt": "fine"}', b'{"prompt": "caf\xe9 \xff"}'],
     r"line 2 is not valid UTF-8.*re-encode the file as UTF-8"),
    ("prompts file with an empty prompt", [b'{"prompt": "fine"}', b'{"prompt": "  "}'],
     r"line 2: its last user turn is empty.*remove empty prompts"),
])
def test_bad_prompt_files_fail_before_work(toy_target, tmp_path, fault, lines, needle,
                                           fault_row):
    source = tmp_path / "prompts.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    cfg = GenerateConfig(source=str(source), num_samples=2)
    with pytest.raises(DraftsmithError, match=f"(?s){needle}"):
        generate.run(cfg, toy_target, tmp_path / "raw")
    assert not (tmp_path / "raw").exists()
    fault_row(fault, "generate refuses before any request, naming the line or row and the fix")


@pytest.fixture(scope="module")
def raw_samples(toy_target, tmp_path_factory) -> Path:
    from draftsmith import generate

    raw = tmp_path_factory.mktemp("raw") / "raw"
    generate.run(GenerateConfig(num_samples=24, max_new_tokens=64, batch_size=8), toy_target,
                 raw)
    return raw


@pytest.fixture(scope="module")
def some_drafter(toy_target, tmp_path_factory) -> Path:
    """A random drafter in the train stage's layout (what `export` reads)."""
    from conftest import random_drafter
    from draftsmith.checkpoint import save_drafter
    from draftsmith.target_info import load_model

    out = tmp_path_factory.mktemp("drafter") / "drafter"
    # aux layers from 2, as vLLM numbers them (an SGLang export refuses a first id of 0)
    save_drafter(random_drafter(load_model(toy_target, "cpu"), 128, aux_layers=(2, 3, 4)), out)
    return out


def _stage_cmd(stage: str, toy_target: Path, inputs: dict, work: Path) -> tuple[list[str], Path]:
    """The stage's command line (as dvc.yaml runs it) and the artifact it writes."""
    from draftsmith.toy.recipes import TINY_TARGET

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["target"]["embedded"].update(TINY_TARGET, train_steps=20)
    params["generate"].update(num_samples=24, max_new_tokens=64, batch_size=4)
    # These tests are about SIGKILL safety, not the toy's quality: tokenize keeps whatever the
    # toy emitted (its malformed share on 24 short samples varies with the CPU that trained it).
    params["tokenize"].update(on_format_error="drop", max_malformed_share=1.0, truncated="keep")
    params["vocab"].update(draft_vocab_size=128)
    params["benchmark"].update(num_prompts=3, max_new_tokens=24, temperatures=[0.0])
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    target = ["--target", toy_target]
    args = {"target": ["--out", work / "target"],
            "generate": [*target, "--out", work / "raw", "--work", work / "gen.work"],
            "tokenize": [*target, "--raw", inputs["raw"], "--out", work / "tok"],
            "vocab": [*target, "--tokenized", work / "tok", "--out", work / "vocab"],
            "export": [*target, "--drafter", inputs["drafter"], "--out", work / "export"],
            "benchmark": [*target, "--drafter", inputs["drafter"], "--export", inputs["drafter"],
                          "--raw", inputs["raw"], "--work", work / "bench.work", "--plot",
                          work / "acceptance.png"]}[stage]
    out = {"target": work / "target", "generate": work / "raw", "tokenize": work / "tok",
           "vocab": work / "vocab", "export": work / "export",
           "benchmark": work / "acceptance.png"}[stage]
    return [sys.executable, "-m", f"stages.{stage}", "--params", str(work / "params.yaml"),
            *map(str, args)], out


# hidden: test_sigkilled_hidden_stage_resumes_to_the_same_artifact; train: test_distributed.py
@pytest.mark.parametrize("stage", ["target", "generate", "tokenize", "vocab", "export",
                                   "benchmark"])
def test_sigkilled_stage_leaves_no_partial_artifact(toy_target, raw_samples, some_drafter,
                                                    tmp_path, stage, fault_row):
    """SIGKILL while the stage writes its artifact (written into its temp sibling, not yet
    renamed; for generate, with finished samples in its journal): no artifact, and the rerun
    ends with the uninterrupted run's artifact and no temp left behind."""
    from draftsmith.generate import JOURNAL_FILE

    inputs = {"raw": raw_samples, "drafter": some_drafter}

    def run(work: Path, kill: bool) -> Path:
        work.mkdir(exist_ok=True)
        if stage == "vocab":  # its input: an uninterrupted tokenize run
            cmd, _ = _stage_cmd("tokenize", toy_target, inputs, work)
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        cmd, out = _stage_cmd(stage, toy_target, inputs, work)
        if not kill:
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
            return out
        # The stage stops with its artifact written to the temp sibling, not yet renamed: the
        # worst moment to die. generate dies once its journal holds finished samples.
        env = dict(os.environ, DRAFTSMITH_FAULT_PAUSE_BEFORE_RENAME="1")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
        deadline = time.time() + 300
        writing = (lambda: (work / "gen.work" / JOURNAL_FILE).exists()) if stage == "generate" \
            else (lambda: any(f.rglob("*.*") for f in out.parent.glob(f".{out.name}.*.tmp")))
        while not writing():
            assert proc.poll() is None and time.time() < deadline, "ended before writing"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return out

    out = run(tmp_path / "killed", kill=True)
    assert not out.exists()
    cmd, _ = _stage_cmd(stage, toy_target, inputs, tmp_path / "killed")
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)  # the rerun
    assert _same_tree(out, run(tmp_path / "ref", kill=False))
    assert not list(out.parent.glob(".*.tmp"))
    fault_row(f"{stage} stage SIGKILLed while writing its artifact", "no partial artifact; the "
              "rerun gives the uninterrupted run's artifact and leaves no temp file")


def _same_tree(a: Path, b: Path) -> bool:
    if a.is_file():
        return a.read_bytes() == b.read_bytes()
    files = lambda d: sorted(p.relative_to(d) for p in d.rglob("*") if p.is_file())  # noqa: E731
    return files(a) == files(b) and all((a / f).read_bytes() == (b / f).read_bytes()
                                        for f in files(a))
