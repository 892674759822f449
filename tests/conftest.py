import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Tests never touch the network: everything they use is made here.
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                  DVC_NO_ANALYTICS="1", TOKENIZERS_PARALLELISM="false")

REPO = Path(__file__).resolve().parents[1]

# Under xdist each worker gets its share of the cores for torch and for the stages, servers and
# torchrun processes its tests start (two workers that each spin 2 OpenMP threads on a 2-core
# machine trained the toy 5x slower than one alone: 78 s against 15 s); once a worker has
# finished, the ones left share its cores too (threads_for_the_workers_left). An
# OMP_NUM_THREADS of the user's own is kept.
USER_THREADS = os.environ.get("OMP_NUM_THREADS")


def share_the_cores(workers_running: int) -> None:
    if USER_THREADS or not os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        return
    threads = max(1, (os.cpu_count() or 1) // max(1, workers_running))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


share_the_cores(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))

sys.path.insert(0, str(REPO / "tools"))

from checkout import copy_checkout  # noqa: E402

from draftsmith.toy.recipes import TINY_TARGET


@pytest.fixture(scope="session")
def toy_target(tmp_path_factory) -> Path:
    """The target artifact (manifest + model) of a tiny embedded toy, built once per session."""
    from draftsmith import target
    from draftsmith.config import EmbeddedTargetConfig, TargetConfig

    out = tmp_path_factory.mktemp("target") / "target"
    target.resolve(TargetConfig(embedded=EmbeddedTargetConfig(**TINY_TARGET)), out)
    return out


@pytest.fixture(scope="session")
def toy_data(toy_target, tmp_path_factory) -> Path:
    """The tiny toy's own answers to 96 prompts, through generate, tokenize, vocab (128 draft
    tokens) and hidden (fp32 states): raw/, tok/, vocab/, hidden/. Built once per session, for
    every method's training tests."""
    from draftsmith import generate, hidden, tokenization, vocab
    from draftsmith.config import GenerateConfig, HiddenConfig, TokenizeConfig, VocabConfig
    from draftsmith.target_info import read_info

    d = tmp_path_factory.mktemp("data")
    generate.run(GenerateConfig(num_samples=96, max_new_tokens=96, batch_size=32), toy_target,
                 d / "raw")
    tokenization.run(TokenizeConfig(on_format_error="drop"), toy_target, d / "raw", d / "tok")
    vocab.run(VocabConfig(draft_vocab_size=128), d / "tok", read_info(toy_target).vocab_size,
              d / "vocab")
    hidden.run(HiddenConfig(dtype="float32"), toy_target, d / "tok", d / "hidden")
    return d


@pytest.fixture(scope="session")
def deepseek_dir(toy_target, tmp_path_factory) -> Path:
    """A random DeepSeek-V3 model with the embedded MLA toy's config and the toy's tokenizer."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    from draftsmith.config import EmbeddedTargetConfig
    from draftsmith.toy.build import _mla_config

    d = tmp_path_factory.mktemp("deepseek")
    tok = AutoTokenizer.from_pretrained(toy_target / "model")
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(_mla_config(EmbeddedTargetConfig(**TINY_TARGET), tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def toy_tokenizer(toy_target):
    from draftsmith.target_info import load_tokenizer

    return load_tokenizer(toy_target)


def copy_repo(dest: Path) -> Path:
    """A fresh git+DVC checkout of the working tree (tracked and untracked, not ignored)."""
    return copy_checkout(REPO, dest)


def cached_checkout(tmp_path_factory, name: str, params: dict) -> Path:
    """A checkout with `params` set (test_pipeline_dvc.set_params) whose DVC cache, run cache
    included, is the persistent test cache (DRAFTSMITH_TEST_CACHE, else ~/.cache/draftsmith):
    what an earlier test or run of the suite computed comes back instead of running again."""
    from test_pipeline_dvc import set_params

    repo = copy_repo(tmp_path_factory.mktemp(name))
    cache = Path(os.environ.get("DRAFTSMITH_TEST_CACHE", Path.home() / ".cache/draftsmith"))
    dvc("config", "--local", "cache.dir", str(cache / "dvc-cache"), cwd=repo)
    set_params(repo, params)
    return repo


def dvc(*args, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True)
    if check and proc.returncode:
        raise AssertionError(f"dvc {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


# Figures the tests measured that a reader of the CI log wants (acceptance, start times).
REPORT: list[str] = []
# The fault suite's table (tests marked `faults` add a row each): printed, and written to
# metrics/faults.json when every fault test ran and passed.
FAULTS: list[dict] = []
# The bad-input suite's tries (test_bad_inputs.attempt adds one each), summed into
# metrics/bad_inputs.json likewise.
BAD_INPUTS: list[dict] = []


@pytest.fixture(autouse=True)
def threads_for_the_workers_left(tmp_path_factory):
    """Before each test under xdist: the cores divided among the workers still running (each
    finished worker leaves a file beside the workers' temp folders)."""
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        finished = len(list(tmp_path_factory.getbasetemp().parent.glob("finished-gw*")))
        share_the_cores(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]) - finished)


@pytest.fixture
def fault_row(request):
    """fault_row(fault, behaviour, samples_lost=0, artifacts_corrupted=0): one row of the fault
    table, recorded only if the test passes (its assertions are what the row claims)."""
    rows = []
    yield lambda fault, behaviour, samples_lost=0, artifacts_corrupted=0: rows.append(
        {"fault": fault, "behaviour": behaviour, "samples_lost": samples_lost,
         "artifacts_corrupted": artifacts_corrupted})
    if not getattr(request.node, "fault_failed", False):
        FAULTS.extend(rows)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if outcome.get_result().failed:
        item.fault_failed = True


# Tests of each suite marker collected. Under xdist (`make test` runs two workers) the
# controller collects nothing itself: the workers send their counts and rows
# (pytest_testnodedown).
MARKED: dict[str, int] = {}


def in_the_vllm_unit(file) -> bool:
    """The vLLM tests' files (named *vllm*): one unit of `make test`'s scheduler."""
    return "vllm" in Path(file).name


def pytest_collection_modifyitems(config, items):
    """The vLLM tests live in files named *vllm*, which `make test`'s scheduler (below) keeps
    together; under xdist they are collected first, so that their unit starts first."""
    for item in items:
        if item.get_closest_marker("vllm") and not in_the_vllm_unit(item.path):
            raise pytest.UsageError(f"{item.nodeid}: a vLLM test outside a file named *vllm*: "
                                    "make test would run it beside another vLLM server")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: not in_the_vllm_unit(item.path))  # stable: file order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` (xdist, two workers): each test file is one unit of work (its module
    fixtures built once, its tests in their order), and the vLLM files are one unit together,
    run first on one worker while the other takes the remaining files: the vLLM tests build
    their toys through one DVC run cache, and assert that no vLLM server is left running, so
    two at once would race; on a 2-core machine one vLLM server keeps one core busy."""
    from xdist.scheduler import LoadScopeScheduling

    class VllmTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "vllm" if in_the_vllm_unit(file) else file

    config.option.loadscopereorder = False  # the collection's order: the vLLM unit first
    return VllmTogether(config, log)


def pytest_sessionfinish(session, exitstatus):
    """The tables are rewritten only by runs of the whole suite (`-m faults` included), never by
    a run of chosen files, which would leave out the others' rows."""
    from draftsmith.serving.server import ManagedServer

    marked = {m: sum(1 for i in session.items if i.get_closest_marker(m))
              for m in ("faults", "bad_inputs")}
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes them
        factory = session.config._tmp_path_factory  # noqa: SLF001  (no fixture at session end)
        (factory.getbasetemp().parent / f"finished-{os.environ['PYTEST_XDIST_WORKER']}").touch()
        session.config.workeroutput["draftsmith"] = json.dumps(
            {"report": REPORT, "faults": FAULTS, "bad_inputs": BAD_INPUTS, "marked": marked,
             "startups": ManagedServer.startups})
        return
    marked = {m: n or MARKED.get(m, 0) for m, n in marked.items()}
    chosen = any(Path(a.split("::")[0]).exists() for a in session.config.invocation_params.args)
    if marked["faults"] and not chosen and exitstatus == 0 and len(FAULTS) >= marked["faults"]:
        rows = sorted(FAULTS, key=lambda r: r["fault"])
        (REPO / "metrics" / "faults.json").write_text(json.dumps(
            {"faults": len(rows), "samples_lost": sum(r["samples_lost"] for r in rows),
             "artifacts_corrupted": sum(r["artifacts_corrupted"] for r in rows),
             "table": rows}, indent=2) + "\n")
    # BAD_INPUTS empty: a --collect-only run
    if marked["bad_inputs"] and BAD_INPUTS and not chosen and exitstatus == 0:
        (REPO / "metrics" / "bad_inputs.json").write_text(json.dumps(
            bad_input_figures(), indent=2) + "\n")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: what a finished worker measured, added to this process's lists."""
    from draftsmith.serving.server import ManagedServer

    sent = json.loads(getattr(node, "workeroutput", {}).get("draftsmith", "{}"))
    REPORT.extend(sent.get("report", []))
    FAULTS.extend(sent.get("faults", []))
    BAD_INPUTS.extend(sent.get("bad_inputs", []))
    ManagedServer.startups.extend(sent.get("startups", []))
    for m, n in sent.get("marked", {}).items():
        MARKED[m] = max(MARKED.get(m, 0), n)


def bad_input_figures() -> dict:
    """What the bad-input suite tried and what users got, per kind of input."""
    def count(rows):
        return {"inputs_tried": len(rows),
                "clear_errors": sum(r["outcome"] == "clear" for r in rows),
                "accepted_as_valid": sum(r["outcome"] == "accepted" for r in rows),
                "raw_tracebacks": sum(r["outcome"] == "raw" for r in rows),
                "errors_without_the_place_or_fix": sum(r["vague"] for r in rows),
                "artifacts_damaged": sum(bool(r["damaged"]) for r in rows)}
    kinds = sorted({r["input"] for r in BAD_INPUTS})
    return {**count(BAD_INPUTS),
            "by_input": {k: count([r for r in BAD_INPUTS if r["input"] == k]) for k in kinds}}


def pytest_terminal_summary(terminalreporter):
    """Print REPORT and how long the real servers the tests started took to become healthy."""
    from draftsmith.serving.server import ManagedServer

    lines = list(REPORT)
    if BAD_INPUTS:
        f = bad_input_figures()
        lines.append("bad inputs: " + ", ".join(f"{k} {v}" for k, v in f.items()
                                                if k != "by_input"))
    for r in sorted(FAULTS, key=lambda r: r["fault"]):
        lines.append(f"fault: {r['fault']}: {r['behaviour']} (samples lost "
                     f"{r['samples_lost']}, artifacts corrupted {r['artifacts_corrupted']})")
    if ManagedServer.startups:
        times = ", ".join(f"{s:.1f}" for s in ManagedServer.startups)
        lines.append(f"servers started: {len(ManagedServer.startups)}, seconds to healthy: {times}")
    if lines:
        terminalreporter.section("measured")
        for line in lines:
            terminalreporter.write_line(line)


def tiny_llama(vocab: int, hidden: int, sharpen: float, max_positions: int):
    """A random 4-layer Llama target, its lm_head scaled so drafts are sometimes right."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=max_positions)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def random_drafter(target, draft_vocab: int, seed: int = 1, aux_layers=(1, 2, 3)):
    """A random EAGLE-3 drafter sized to `target`, sharing its embeddings; the draft vocab is
    the first `draft_vocab` tokens (d2t offsets 0)."""
    import torch

    from draftsmith.drafters.registry import DrafterConfig
    from draftsmith.drafters.eagle3 import Eagle3Drafter

    torch.manual_seed(seed)
    h, v = target.config.hidden_size, target.config.vocab_size
    c = DrafterConfig(hidden_size=h, target_hidden_size=h, num_heads=2, num_kv_heads=1,
                      head_dim=h // 2, intermediate_size=2 * h, vocab_size=v,
                      draft_vocab_size=draft_vocab, aux_layers=tuple(aux_layers))
    d = Eagle3Drafter(c)
    d.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    d.t2d[torch.arange(draft_vocab)] = True
    return d.eval()
