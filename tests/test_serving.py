"""The serving pieces that need no engine: the resume journal, rebuilding the emitted text
from a chat response, reading Prometheus counters, engine command lines, and the client's
failure handling against closed ports. Live vLLM behaviour is in test_vllm.py."""

import json
import shlex
import sys

import pytest

from draftsmith.chat_format import FORMATS, ChatFormat
from draftsmith.config import ConfigError, ServerConfig, load_config
from draftsmith.errors import DraftsmithError
from draftsmith.export import speculative_args
from draftsmith.journal import Journal
from draftsmith.serving import prometheus
from draftsmith.serving.acceptance import Counters
from draftsmith.serving.client import ChatClient, ChatRequest, RequestFailed, raw_completion
from draftsmith.serving.server import ManagedServer, free_port, reasoning_parser, server_argv

QWEN3, R1, CHATML = FORMATS["qwen3"], FORMATS["deepseek-r1"], FORMATS["chatml"]


def rec(i):
    return {"id": f"id{i}", "content": f"answer {i}"}


def test_journal_resumes_out_of_order_work_exactly_once(tmp_path):
    j = Journal(tmp_path / "journal.jsonl", key="k1")
    j.open(j.load())
    for i in (3, 0, 2):  # finished out of order
        j.append(rec(i))
    j.append(rec(2))  # a retried sample finishing twice
    j.close()
    with open(j.path, "a") as f:
        f.write('{"id": "id1", "content": "torn by a ki')  # the process died mid-write
    again = Journal(tmp_path / "journal.jsonl", key="k1")
    done = again.load()
    assert sorted(done) == ["id0", "id2", "id3"]  # torn line dropped, duplicate collapsed
    again.open(done)
    again.append(rec(1))
    again.close()
    assert sorted(Journal(j.path, key="k1").load()) == ["id0", "id1", "id2", "id3"]
    lines = j.path.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # the rewrite left no torn line behind


def test_journal_of_other_work_is_not_mixed_in(tmp_path):
    j = Journal(tmp_path / "j.jsonl", key="params-A")
    j.open({})
    j.append(rec(0))
    j.close()
    assert Journal(tmp_path / "j.jsonl", key="params-B").load() == {}
    assert Journal(tmp_path / "j.jsonl", key="params-A").load() == {"id0": rec(0)}


EMITTED = "<think>\nstep one\nstep two\n</think>\n\n42<|im_end|>"


@pytest.mark.parametrize("message", [
    {"content": "\n\n42", "reasoning": "\nstep one\nstep two\n"},  # vLLM
    {"content": "\n\n42", "reasoning_content": "\nstep one\nstep two\n"},  # SGLang, older vLLM
    {"content": "<think>\nstep one\nstep two\n</think>\n\n42"},  # no reasoning parser
])
def test_raw_completion_rebuilds_what_the_model_emitted(message):
    assert raw_completion(message, "stop", QWEN3) == EMITTED
    reasoning, content, closed, finished = QWEN3.parse(EMITTED, thinking=True)
    assert (reasoning, content, closed, finished) == ("step one\nstep two", "42", True, True)


def test_raw_completion_cut_off_while_thinking():
    msg = {"content": None, "reasoning": "\nstep one\nst"}
    text = raw_completion(msg, "length", QWEN3)
    assert text == "<think>\nstep one\nst"
    assert QWEN3.parse(text, thinking=True)[2] is False  # think block not closed


def test_raw_completion_for_a_prompt_that_opens_the_think_block():
    msg = {"content": "\n\n42", "reasoning": "step\n"}
    assert raw_completion(msg, "stop", R1) == "step\n</think>\n\n42" + R1.end_of_turn
    assert raw_completion({"content": "hi"}, "stop", CHATML) == "hi<|im_end|>"


METRICS = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 21.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 63.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 53.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="1"} 18.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="2"} 15.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="t"} 1.79e+09
"""


def test_acceptance_from_vllm_counters():
    s = prometheus.parse(METRICS)
    assert prometheus.total(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                            position="1") == 18.0
    zero = Counters(0, 0, 0, [0, 0, 0])
    after = Counters(*(prometheus.total(s, f"vllm:spec_decode_{n}_total")
                       for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")),
                     [20.0, 18.0, 15.0])
    summary = (after - zero).summary()
    assert summary["acceptance_length"] == round((21 + 53) / 21, 4)  # 1 + accepted per draft
    assert summary["acceptance_rate_per_position"] == [round(x / 21, 4) for x in (20, 18, 15)]
    assert summary["conditional_acceptance_per_position"] == [round(20 / 21, 4), 0.9,
                                                              round(15 / 18, 4)]
    assert summary["draft_acceptance_rate"] == round(53 / 63, 4)


def test_vllm_and_sglang_command_lines(tmp_path):
    common = dict(model_dir=tmp_path / "my model", served_name="Qwen/Qwen3-8B", port=8123,
                  dtype="bfloat16", seed=7)
    v = server_argv(ServerConfig(), chat_format=FORMATS["deepseek-r1"], **common)
    assert v[:3] == ["vllm", "serve", str(tmp_path / "my model")]  # a path with a space survives
    assert v[v.index("--host") + 1] == "127.0.0.1"  # bound to loopback unless configured
    assert v[v.index("--reasoning-parser") + 1] == "deepseek_r1"
    s = server_argv(ServerConfig(engine="sglang", extra_args="--tp 8"), chat_format=FORMATS["qwen3"],
                    **common)
    assert s[:4] == ["python", "-m", "sglang.launch_server", "--model-path"]
    assert "--random-seed" in s and s[-2:] == ["--tp", "8"]
    assert "--reasoning-parser" not in s  # SGLang's parser may strip whitespace: keep it inline
    assert "--reasoning-parser" not in server_argv(ServerConfig(), chat_format=FORMATS["chatml"],
                                                   **common)
    kimi = ChatFormat("template", "<|im_end|>", "<think>", "</think>", source="template")
    magistral = ChatFormat("template", "</s>", "[THINK]", "[/THINK]", source="template")
    assert reasoning_parser(kimi) == "qwen3" and reasoning_parser(magistral) is None
    spec = speculative_args("vllm", tmp_path, 3)
    assert json.loads(spec[1]) == {"method": "eagle3", "model": str(tmp_path),
                                   "num_speculative_tokens": 3}
    # server.speculative_config's keys join ours (vLLM drafts greedily unless told)
    more = {"draft_sample_method": "probabilistic"}
    assert json.loads(speculative_args("vllm", tmp_path, 3, more)[1]) == {
        "draft_sample_method": "probabilistic", "method": "eagle3", "model": str(tmp_path),
        "num_speculative_tokens": 3}
    sg = shlex.join(speculative_args("sglang", tmp_path, 3))
    assert "--speculative-algorithm EAGLE3" in sg and "--speculative-num-steps 3" in sg
    assert "--speculative-num-draft-tokens 4 --speculative-num-steps 3" in sg
    assert "--speculative-eagle-topk 1" in sg
    # A DFlash export says so in its config: vLLM's method dflash (its only way to tell),
    # SGLang's DFLASH with the whole block verified, no chain flags. The method is read in
    # our words, so an export written for one engine is served by the other by its own name.
    (tmp_path / "config.json").write_text(json.dumps(
        {"draftsmith": {"method": "dflash", "speculative_method": "DFLASH"}}))
    assert json.loads(speculative_args("vllm", tmp_path, 3)[1])["method"] == "dflash"
    sg = speculative_args("sglang", tmp_path, 3)
    assert shlex.join(sg).startswith("--speculative-algorithm DFLASH")
    assert "--speculative-num-draft-tokens" in sg and "--speculative-num-steps" not in sg
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLMEagle3"], "fc_norm": True,
         "draftsmith": {"method": "eagle3.1", "speculative_method": "EAGLE3"}}))
    assert json.loads(speculative_args("vllm", tmp_path, 3)[1])["method"] == "eagle3"


@pytest.mark.parametrize("params, needle", [
    ("generate:\n  backend: openai\n", "server.urls"),
    ("server:\n  urls: [127.0.0.1:8000]\n", "must start with http"),
    ("generate:\n  server:\n    launch: true\n", "'server' is a top-level section"),
    ("server:\n  command: vllm serve\n", "{model}"),
])
def test_server_config_errors_name_the_fix(tmp_path, params, needle):
    p = tmp_path / "params.yaml"
    p.write_text(params)
    with pytest.raises(ConfigError, match=needle):
        load_config(p)


def test_client_gives_up_on_dead_servers_with_a_clear_error(monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-secret-value")
    dead = [f"http://127.0.0.1:{free_port('127.0.0.1')}/v1" for _ in range(2)]
    cfg = ServerConfig(urls=dead, model="m", max_retries=2, backoff_s=0.01, api_key_env="MY_KEY")
    client = ChatClient(cfg, dead, QWEN3)
    reqs = [ChatRequest(f"s{i}", [{"role": "user", "content": "hi"}], {}) for i in range(5)]
    with pytest.raises(RequestFailed) as err:
        list(client.stream(reqs))
    text = str(err.value)
    assert "failed after 3 attempt(s)" in text and "resumes" in text
    assert "sk-secret-value" not in text  # the key never reaches an error or a log
    with pytest.raises(DraftsmithError, match="cannot list models at any server"):
        ChatClient(cfg.model_copy(update={"model": None}), dead, QWEN3)


def test_server_that_dies_at_start_fails_fast_with_its_log(tmp_path):
    server = ManagedServer(["python3", "-c", "import sys; print('bad flag --foo'); sys.exit(3)"],
                           host="127.0.0.1", port=free_port("127.0.0.1"),
                           log_file=tmp_path / "server.log", startup_timeout_s=60)
    with pytest.raises(DraftsmithError) as err:
        server.start()
    assert "exited (code 3)" in str(err.value) and "bad flag --foo" in str(err.value)


def test_a_server_that_dies_names_its_root_cause_first(tmp_path):
    """An engine whose worker raised, then whose parent raised a wrapper ("see root cause
    above") and printed more: the error leads with the worker's exception, not the wrapper."""
    script = ("import sys\n"
              "print('WARNING [utils.py:2] Found ulimit: `OSError: [Errno 24] Too many open "
              "files`. Consider increasing it')\n"
              "print('(Worker pid=7) ERROR 12-04 [executor.py:9] ValueError: There is no module "
              "or parameter named fc_norm in LlamaModel', flush=True)\n"
              "print('Traceback (most recent call last):\\n  File \"x.py\", line 1')\n"
              "print('RuntimeError: Engine core initialization failed. See root cause above.')\n"
              + "print('  shutdown line')\n" * 40 + "sys.exit(1)\n")
    server = ManagedServer([sys.executable, "-c", script], host="127.0.0.1",
                           port=free_port("127.0.0.1"), log_file=tmp_path / "server.log",
                           startup_timeout_s=60)
    with pytest.raises(DraftsmithError) as err:
        server.start()
    first = str(err.value).splitlines()[0]
    assert first.endswith("healthy: ValueError: There is no module or parameter named fc_norm "
                          "in LlamaModel; last lines of " + str(tmp_path / "server.log") + ":")


def test_engines_that_disagree_are_flagged():
    from draftsmith.benchmark import engine_gaps

    by_engine = {"reference": [{"temperature": 0.0, "acceptance_length": 2.85},
                               {"temperature": 0.6, "acceptance_length": 3.12}],
                 "vllm": [{"temperature": 0.0, "acceptance_length": 2.93},
                          {"temperature": 0.6, "acceptance_length": 1.01}]}
    assert engine_gaps(by_engine) == {0.6: {"reference": 3.12, "vllm": 1.01}}
    assert engine_gaps({"reference": by_engine["reference"]}) == {}


def test_a_gap_at_t_above_0_names_sampling_noise_and_at_t_0_blames_the_engine():
    from draftsmith.benchmark import gap_warnings

    greedy, sampled = gap_warnings({0.0: {"reference": 1.9, "sglang": 1.5},
                                    0.6: {"reference": 1.26, "sglang": 1.39}})
    assert "T=0.0" in greedy and "not running this drafter as trained" in greedy
    assert "noise" not in greedy  # same texts at T=0: no sampling to blame
    assert "T=0.6" in sampled and "sampling noise" in sampled and "reference_seeds" in sampled
    assert gap_warnings({}) == []


def test_a_gap_at_t_above_0_is_judged_by_the_references_standard_error():
    from draftsmith.benchmark import gap_warnings

    # 2 sqrt(2) x 0.05 = 0.141: the MLA toy's SGLang gap (0.13) is within it, vLLM's greedy
    # drafts at T=0.6 on the Llama toy (0.74) far beyond; at T=0 no error excuses a gap
    se = {0.0: 0.05, 0.6: 0.05}
    noise, engine = gap_warnings({0.6: {"reference": 1.26, "sglang": 1.39}}, se), gap_warnings(
        {0.6: {"reference": 3.25, "vllm": 2.51}}, se)
    assert "within sampling noise" in noise[0] and "0.141" in noise[0]
    assert "WARNING" not in noise[0]
    assert "WARNING" in engine[0] and "more than sampling explains" in engine[0]
    assert "greedy drafts" in engine[0]
    greedy = gap_warnings({0.0: {"reference": 1.9, "sglang": 1.85}}, se)[0]
    assert "WARNING" in greedy and "not running this drafter as trained" in greedy
    # no error known (no reference engine in the run): the hedged warning
    assert "reference_seeds" in gap_warnings({0.6: {"vllm": 1.26, "sglang": 1.39}}, {})[0]
