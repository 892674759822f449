"""serving/engines.py is the one place that knows the serving engines: every entry is complete,
and the server's command line, the client's reasoning fields, the acceptance counters, the
export's config keys and the config's choices all come from it. Adding an engine is one entry
there; these tests then cover it too."""

import dataclasses
import shlex
import typing

import pytest
import torch

from draftsmith import export
from draftsmith.chat_format import FORMATS
from draftsmith.config import BenchmarkConfig, ServerConfig, TargetConfig
from draftsmith.drafters.registry import METHODS, DrafterConfig
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.export import speculative_args
from draftsmith.serving import acceptance, prometheus
from draftsmith.errors import DraftsmithError
from draftsmith.serving.client import emitted_ids, raw_completion
from draftsmith.serving.engines import (DEFAULT, ENGINES, MEASURABLE, NAMES, REASONING_FIELDS,
                                        REFERENCE, Engine)
from draftsmith.serving.server import reasoning_parser, server_argv

ENGINE = pytest.mark.parametrize("name", NAMES)


@ENGINE
def test_each_entry_is_complete(name, tmp_path):
    e = ENGINES[name]
    assert e.name == name and e.label
    assert "{model}" in e.launch and e.seed_flag.startswith("--")
    assert e.think_parsers is None or (len(e.think_parsers) == 2 and all(e.think_parsers))
    assert e.reasoning_fields and all(f in REASONING_FIELDS for f in e.reasoning_fields)
    args = e.speculative_args(tmp_path / "draft", 3, METHODS["eagle3"].engine_names[name])
    assert args and all(isinstance(a, str) for a in args)
    assert any(str(tmp_path / "draft") in a for a in args)  # it drafts with the given export
    # what each engine calls the methods it serves: every engine EAGLE-3, 3.1 and DFlash,
    # vLLM every method (P-EAGLE's parallel drafting: vLLM alone)
    served = {n for n, m in METHODS.items() if name in m.engine_names}
    assert served >= {"eagle3", "eagle3.1", "dflash"}
    assert served == set(METHODS) or name != "vllm"
    if e.spec_metrics is not None:
        assert all(dataclasses.astuple(e.spec_metrics))
    if e.spec_response is not None:
        assert e.spec_response.request and callable(e.spec_response.read)
    assert e.token_id_fields and all(v is True for v in e.token_id_fields.values())
    assert e.aux_convention and e.aux_id_offset >= 0
    assert e.layer_ids([2, 16, 29]) == [k - e.aux_id_offset for k in (2, 16, 29)]
    assert (e.first_aux_id is None) == (not e.first_aux_id_why)


def test_config_choices_come_from_the_tables():
    """config.py names the engines without importing the table (every stage imports config;
    editing the table must not rerun them all): the names must be the table's."""
    assert typing.get_args(ServerConfig.model_fields["engine"].annotation) == NAMES
    assert ServerConfig().engine == DEFAULT in ENGINES
    engines = typing.get_args(BenchmarkConfig.model_fields["engines"].annotation)[0]
    assert typing.get_args(engines) == (REFERENCE, *MEASURABLE)
    formats = typing.get_args(TargetConfig.model_fields["chat_format"].annotation)[0]
    assert typing.get_args(formats) == ("auto", *FORMATS)


@ENGINE
def test_server_command_line_comes_from_the_entry(name, tmp_path):
    e = ENGINES[name]
    argv = server_argv(ServerConfig(engine=name), model_dir=tmp_path / "m", served_name="t",
                       port=8000, dtype="bfloat16", seed=7, chat_format=FORMATS["qwen3"],
                       extra=speculative_args(name, tmp_path / "d", 2))
    launch = shlex.split(e.launch.format(model=shlex.quote(str(tmp_path / "m"))))
    assert argv[:len(launch)] == launch
    assert argv[argv.index(e.seed_flag) + 1] == "7"
    assert ("--reasoning-parser" in argv) == (e.think_parsers is not None)
    if e.think_parsers:
        assert argv[argv.index("--reasoning-parser") + 1] == e.think_parsers[0]
        assert reasoning_parser(FORMATS["deepseek-r1"], name) == e.think_parsers[1]
    spec = e.speculative_args(tmp_path / "d", 2, METHODS["eagle3"].engine_names[name])
    assert argv[-len(spec):] == spec


@ENGINE
def test_client_reads_the_reasoning_where_the_engine_puts_it(name):
    fmt = FORMATS["qwen3"]
    emitted = fmt.open_tag + "\nthink\n" + fmt.close_tag + "\n\nanswer" + fmt.end_of_turn
    for field in ENGINES[name].reasoning_fields:
        msg = {field: "\nthink\n", "content": "\n\nanswer"}
        assert raw_completion(msg, "stop", fmt) == emitted


@pytest.mark.parametrize("name", [n for n in MEASURABLE if ENGINES[n].spec_metrics])
def test_acceptance_reads_the_engines_counters(name, monkeypatch):
    m = ENGINES[name].spec_metrics
    text = "\n".join([f"{m.drafts} 10", f"{m.draft_tokens} 30", f"{m.accepted} 12",
                      *(f'{m.accepted_per_position}{{position="{i}"}} {v}'
                        for i, v in enumerate((8, 3, 1)))]) + "\n"
    monkeypatch.setattr(prometheus, "scrape", lambda url: prometheus.parse(text))
    c = acceptance.Counters.scrape("http://x/v1", 3, name)
    assert (c.drafts, c.draft_tokens, c.accepted, c.accepted_at) == (10, 30, 12, [8, 3, 1])


def test_sglang_acceptance_is_summed_from_each_response():
    """SGLang 0.5.17 has no acceptance counters on /metrics; each finished request asked with
    `return_meta_info` carries its own (field names from its tokenizer_manager.py; SGLang
    cannot run here, so this checks the format, not a live server)."""
    k = 3

    def choice(hist):  # hist[n]: verify steps that accepted n of the k drafts
        steps, correct = sum(hist), sum(n * c for n, c in enumerate(hist))
        return {"index": 0, "finish_reason": "stop", "token_ids": [5, 6, 2], "meta_info": {
            "spec_verify_ct": steps, "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": steps * k, "spec_accept_length": 9.9,
            "spec_correct_drafts_histogram": hist}}

    a, b = choice([1, 2, 0, 3]), choice([0, 0, 4])
    ended_at_prefill = {"meta_info": {"completion_tokens": 1}}
    c = acceptance.Counters.from_responses([a, b, ended_at_prefill], k, "sglang")
    # 10 steps; accepted 2 + 0 + 9 + 8 = 19; position i reached by steps accepting > i drafts
    assert (c.drafts, c.draft_tokens, c.accepted) == (10, 30, 19)
    assert c.accepted_at == [9, 7, 3]
    s = c.summary()
    assert s["acceptance_length"] == round((10 + 19) / 10, 4)
    assert s["acceptance_rate_per_position"] == [0.9, 0.7, 0.3]
    assert s["conditional_acceptance_per_position"] == [0.9, round(7 / 9, 4), round(3 / 7, 4)]
    assert emitted_ids(a) == [5, 6, 2]
    # the same counts reported under 0.5.x's older histogram name
    old = {"meta_info": {**a["meta_info"], "spec_accept_histogram": [1, 2, 0, 3]}}
    del old["meta_info"]["spec_correct_drafts_histogram"]
    assert acceptance.Counters.from_responses([old], k, "sglang").accepted_at == [5, 3, 3]
    # verify steps without a histogram: said, not counted as zero
    bare = {"meta_info": {"spec_verify_ct": 4, "spec_num_correct_drafts": 2}}
    with pytest.raises(DraftsmithError, match="histogram"):
        acceptance.Counters.from_responses([bare], k, "sglang")


def test_export_writes_each_engines_keys(tmp_path):
    c = DrafterConfig(hidden_size=32, target_hidden_size=32, num_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=64, vocab_size=100, draft_vocab_size=20,
                      aux_layers=(2, 4, 5))
    model = Eagle3Drafter(c)
    draft = torch.arange(0, 100, 5)
    model.d2t.copy_(draft - torch.arange(20))
    model.t2d.zero_()
    model.t2d[draft] = True
    export.export(model, tmp_path / "x", dtype="float32")
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == sorted(NAMES)
    for name, e in ENGINES.items():
        cfg = export._config(c, e, "float32", {}, None)
        ids = e.layer_ids(c.aux_layers)
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
        assert ("eagle_aux_hidden_state_layer_ids" in cfg) == e.top_level_aux_ids
        assert cfg["draftsmith"]["engine"] == name
        assert cfg["draftsmith"]["aux_layer_convention"] == e.aux_convention
        summary = export.validate(tmp_path / "x" / name, target_num_layers=8,
                                  target_hidden_size=32, target_vocab_size=100)
        assert summary["engine"] == name and summary["aux_layer_ids"] == ids


def test_a_new_engine_is_one_entry(monkeypatch, tmp_path):
    """An engine added to the table is launched, drafted with and exported with no other edit
    than its word for each method it serves (the method's engine_names)."""
    from draftsmith.serving import engines, server

    toy = Engine(name="toy", label="Toy", launch="toyserve --model {model}", seed_flag="--s",
                 think_parsers=None, reasoning_fields=("reasoning",),
                 speculative_args=lambda d, k, m, more: ["--draft", str(d), "--k", str(k), "--m", m],
                 spec_metrics=None, aux_id_offset=0, aux_convention="as vLLM",
                 top_level_aux_ids=False, token_id_fields={"ids": True})
    monkeypatch.setitem(engines.ENGINES, "toy", toy)
    monkeypatch.setitem(METHODS["eagle3"].engine_names, "toy", "eagle")
    cfg = ServerConfig.model_construct(**{**ServerConfig().model_dump(), "engine": "toy"})
    argv = server.server_argv(cfg, model_dir=tmp_path, served_name="t", port=1, dtype="f",
                              seed=3, chat_format=FORMATS["qwen3"],
                              extra=speculative_args("toy", tmp_path, 2))
    assert argv[:3] == ["toyserve", "--model", str(tmp_path)]
    assert argv[-4:] == ["--k", "2", "--m", "eagle"]
