"""The bad-input suite: every input a user hands the pipeline, broken the ways files and
servers break (truncated, empty, wrong encoding, wrong types, missing and extra fields, huge
values, one bad row among many good ones, a file that is not what its name says), by hand and
generated (hypothesis, derandomized: the same cases every run). Each must end in a
DraftsmithError that names the input, the place in it and the fix, or be accepted as valid;
never a raw traceback, and never a half-written artifact or a finished one changed.

`attempt` classifies each try and adds a row to conftest.BAD_INPUTS; a run of the whole suite
writes the figures to metrics/bad_inputs.json (docs/troubleshooting.md lists the errors).
"""

import hashlib
import json
import os
import shutil
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BAD_INPUTS, REPO
from draftsmith import export, generate, target
from draftsmith.checkpoint import load_drafter, load_drafter_weights
from draftsmith.config import GenerateConfig, ServerConfig, TargetConfig, load_config
from draftsmith.errors import DraftsmithError
from draftsmith.prompts import load_prompts

pytestmark = pytest.mark.bad_inputs
FUZZ = settings(derandomize=True, deadline=None, max_examples=60,
                suppress_health_check=list(HealthCheck))


def _digest(path: Path) -> str:
    if not path.exists():
        return "absent"
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def attempt(input_kind: str, case: str, fn, *, outputs=(), kept=(), named=None):
    """Run fn() on one bad (or maybe valid) input and record what the user got.
    outputs: paths the call would write, which must not exist after a refusal; kept: paths
    whose content must not change either way; named: text the error must contain (the input's
    path, its line or row). -> 'clear' | 'accepted' | 'raw', and the error."""
    before = {p: _digest(p) for p in kept}
    try:
        fn()
        outcome, error = "accepted", None
    except DraftsmithError as exc:
        outcome, error = "clear", exc
    except Exception as exc:  # noqa: BLE001 (what the suite counts)
        outcome, error = "raw", exc
    damaged = [str(p) for p in outputs if outcome != "accepted" and Path(p).exists()] + \
        [str(p) for p in kept if _digest(p) != before[p]]
    vague = outcome == "clear" and (not error.fix or (named and named not in error.problem))
    BAD_INPUTS.append({"input": input_kind, "case": case, "outcome": outcome,
                       "damaged": damaged, "vague": bool(vague),
                       "message": str(error).splitlines()[0][:200] if error else None})
    assert outcome != "raw", "".join(traceback.format_exception(error))
    assert not damaged, damaged
    assert not vague, f"the error does not name {named!r} or has no fix: {error}"
    return outcome, error


# ----------------------------------------------------------------------------- prompt sources

GOOD = [{"prompt": f"question {i}"} for i in range(30)]


def _jsonl(rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _parquet(rows, path: Path) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path.read_bytes()


PROMPT_FILES = {  # name -> (bytes or a function of tmp_path, text the error must name or None)
    "empty.jsonl": (b"", "holds no rows"),
    "blank_lines.jsonl": (b"\n\n  \n", "holds no rows"),
    "truncated.jsonl": (_jsonl(GOOD[:3])[:-9], "line 3"),
    "latin1.jsonl": ('{"prompt": "caf\xe9"}\n'.encode("latin1"), "line 1"),
    "utf16.jsonl": (_jsonl(GOOD[:2]).decode().encode("utf-16"), "line 1"),
    "nul_bytes.jsonl": (b'{"prompt": "a"}\n\x00\x00\x00', "NUL"),
    "one_bad_line_of_61.jsonl": (_jsonl(GOOD) + b"{bad\n" + _jsonl(GOOD[:30]), "line 31"),
    "not_objects.jsonl": (b'["a", "b"]\n"text"\n', "line 1"),
    "wrong_type.jsonl": (b'{"prompt": 5}\n', "line 1"),
    "null_prompt.jsonl": (b'{"prompt": null}\n', "line 1"),
    "empty_prompt.jsonl": (_jsonl(GOOD[:2]) + b'{"prompt": "  "}\n', "line 3"),
    "unknown_columns.jsonl": (b'{"text": "a"}\n', "columns ['text']"),
    "column_missing_in_a_row.jsonl": (_jsonl(GOOD[:2]) + b'{"other": "x"}\n', "line 3"),
    "messages_no_content.jsonl": (b'{"messages": [{"role": "user"}]}\n', "line 1"),
    "messages_no_user.jsonl": (b'{"messages": [{"role": "system", "content": "s"}]}\n',
                               "line 1"),
    "messages_not_a_list.jsonl": (b'{"messages": 7}\n', "line 1"),
    "sharegpt_unknown_role.jsonl": (b'{"conversations": [{"from": "alien", "value": "x"}]}\n',
                                    "line 1"),
    "deep_nesting.jsonl": (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "line 1"),
    "huge_prompt.jsonl": (json.dumps({"prompt": "x y " * 50_000}).encode() + b"\n",
                          "do not fit the target's context"),
    "extra_fields.jsonl": (_jsonl([{**r, "meta": {"a": [1, 2]}, "n": 3} for r in GOOD]), None),
    "bom.jsonl": (b"\xef\xbb\xbf" + _jsonl(GOOD), None),
    "array.json": (json.dumps(GOOD).encode(), None),
    "array_bad_item.json": (json.dumps(GOOD[:3] + [5]).encode(), "item 3"),
    "array_truncated.json": (json.dumps(GOOD)[:-20].encode(), "not valid JSON"),
    "jsonl_named_json.json": (_jsonl(GOOD), None),
    "parquet_named_jsonl.jsonl": (lambda tmp: _parquet(GOOD, tmp / "p.parquet"), "Parquet"),
    "garbage.parquet": (b"not a parquet file at all", "garbage.parquet"),
    "truncated.parquet": (lambda tmp: _parquet(GOOD, tmp / "q.parquet")[:-40], "truncated"),
    "wrong_types.parquet": (lambda tmp: _parquet([{"prompt": i} for i in range(5)],
                                                 tmp / "r.parquet"), "row 0"),
    "good.parquet": (lambda tmp: _parquet(GOOD, tmp / "s.parquet"), None),
}


def _write_source(tmp_path, name) -> Path:
    data, _ = PROMPT_FILES[name]
    data = data(tmp_path) if callable(data) else data
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name", list(PROMPT_FILES))
def test_a_broken_prompt_source_is_named_before_any_work(name, toy_target, tmp_path):
    """The generate stage on each file: refused with the file, the line or row and the fix,
    before the model loads, with no output; or read, if the file is valid after all."""
    source = _write_source(tmp_path, name)
    named = PROMPT_FILES[name][1]
    cfg = GenerateConfig(source=str(source), num_samples=1, max_new_tokens=8)
    out = tmp_path / "raw"
    outcome, err = attempt("prompt source", name,
                           lambda: generate.run(cfg, toy_target, out),
                           outputs=[out], kept=[toy_target], named=named)
    assert (outcome == "clear") == (named is not None), err
    if outcome == "clear":
        assert str(source) in err.problem or name in err.problem


def test_one_bad_row_in_ten_thousand_can_be_dropped_and_counted(tmp_path):
    """generate.on_bad_row: drop skips the broken rows, says how many and where the first is,
    and keeps every good one; fail (the default) names the first."""
    rows = [{"prompt": f"p{i}"} for i in range(10_000)]
    data = _jsonl(rows[:4_000]) + b'{"prompt": ' + b"\n" + _jsonl(rows[4_000:])
    src = tmp_path / "big.jsonl"
    src.write_bytes(data)
    dropped = []
    attempt("prompt source", "10K rows, one bad, dropped",
            lambda: dropped.append(load_prompts(str(src), split="train", fmt="auto",
                                                column=None, limit=20_000, seed=0,
                                                on_bad_row="drop", dropped=dropped)))
    prompts = dropped.pop()
    assert len(prompts) == 10_000 and len(dropped) == 1 and "line 4001" in dropped[0]
    outcome, err = attempt("prompt source", "10K rows, one bad, refused",
                           lambda: load_prompts(str(src), split="train", fmt="auto",
                                                column=None, limit=20_000, seed=0),
                           named="line 4001")
    assert outcome == "clear" and "on_bad_row: drop" in err.fix


def test_the_generate_stage_reports_dropped_rows(toy_target, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_bytes(_jsonl(GOOD[:3]) + b"not json\n" + b'{"prompt": 1}\n')
    cfg = GenerateConfig(source=str(src), num_samples=3, max_new_tokens=8, on_bad_row="drop")
    m = generate.run(cfg, toy_target, tmp_path / "raw")
    assert m["bad_rows_dropped"] == 2 and m["samples"] == 3


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["prompt", "messages", "conversations", "role", "content", "from",
                         "value", "x"]), inner, max_size=4),
    max_leaves=12)


@FUZZ
@given(rows=st.lists(json_values, min_size=1, max_size=5),
       fmt=st.sampled_from(["auto", "messages", "sharegpt", "prompt"]))
def test_generated_rows_of_any_shape(tmp_path_factory, rows, fmt):
    src = tmp_path_factory.mktemp("rows") / "p.jsonl"
    src.write_bytes(_jsonl(rows))
    attempt("prompt source", f"generated rows, format {fmt}",
            lambda: load_prompts(str(src), split="train", fmt=fmt, column=None, limit=10,
                                 seed=0))


@FUZZ
@given(cut=st.integers(0, 2_000), flips=st.lists(st.tuples(st.integers(0, 2_000),
                                                         st.integers(0, 255)), max_size=4))
def test_generated_damage_to_a_good_file(tmp_path_factory, cut, flips):
    data = bytearray(_jsonl([{"messages": [{"role": "user", "content": f"q{i} é"}]}
                             for i in range(40)]))
    for at, byte in flips:
        data[at % len(data)] = byte
    src = tmp_path_factory.mktemp("damaged") / "p.jsonl"
    src.write_bytes(bytes(data[: len(data) - cut]))
    attempt("prompt source", "generated damage (cut, flipped bytes)",
            lambda: load_prompts(str(src), split="train", fmt="auto", column=None, limit=100,
                                 seed=0))


# ----------------------------------------------------------------------------- params.yaml


def _params(tmp_path, text: str) -> Path:
    f = tmp_path / "params.yaml"
    f.write_text(text) if isinstance(text, str) else f.write_bytes(text)
    return f


PARAMS = {
    "yaml syntax": ("train: {steps: [1, 2\n", "not valid YAML"),
    "not utf-8": ("train:\n  init: caf\xe9\n".encode("latin1"), "UTF-8"),
    "a list": ("- 1\n- 2\n", "mapping"),
    "a section as a number": ("train: 5\n", "train"),
    "unknown section": ("trian: {steps: 1}\n", "trian"),
    "unknown key": ("train: {stpes: 1}\n", "train.stpes"),
    "infinite lr": ("train: {lr: .inf}\n", "train.lr"),
    "nan step weight": ("train: {step_weight: .nan}\n", "train.step_weight"),
    "huge integer": ("train: {steps: 1e400}\n", "train.steps"),
    "negative k": ("benchmark: {num_speculative_tokens: -2}\n", "benchmark.num_speculative_tokens"),
    "block beside k": ("train: {method: dflash, dflash: {block_size: 9}}\n", "block_size=9"),
    "dflash on mla": ("train: {method: dflash, drafter_arch: mla}\n", "drafter_arch"),
    "unknown dflash loss": ("train: {method: dflash, dflash: {loss: dpace}}\n",
                            "train.dflash.loss"),
    "d-pace alpha past 1": ("train: {method: dflash, dflash: {loss: d-pace, dpace_alpha: 1.5}}\n",
                            "train.dflash.dpace_alpha"),
    "best checkpoint of none": ("train: {select: best_acceptance, save_every: 0}\n",
                                "train.select: best_acceptance scores each checkpoint"),
    "unknown selection": ("train: {select: best}\n", "train.select"),
    "p-eagle deeper than trained": ("train: {method: p-eagle, ttt_steps: 2}\n",
                                    "train.ttt_steps=2 trains P-EAGLE's first 2 depths"),
    "prompt file missing": ("generate: {source: nowhere.jsonl}\n", "nowhere.jsonl"),
    "deeply nested": ("train: " + "[" * 5000 + "]" * 5000 + "\n", None),
}


@pytest.mark.parametrize("case", list(PARAMS))
def test_a_broken_params_file_is_named(case, tmp_path):
    text, named = PARAMS[case]
    f = _params(tmp_path, text)
    outcome, err = attempt("params.yaml", case, lambda: load_config(f), named=named)
    assert outcome == "clear"


@pytest.mark.parametrize("override, named", [("train.steps", "is not key=value"),
                                             ("train.steps=[1", "not YAML"),
                                             ("train.lr.x=1", "'lr' is not a section"),
                                             ("generate.source=", "generate.source")])
def test_a_broken_override_is_named(override, named, tmp_path):
    f = _params(tmp_path, (REPO / "params.yaml").read_text())
    outcome, _ = attempt("params override (--set)", override,
                         lambda: load_config(f, [override]), named=named)
    assert outcome == "clear"


_BASE = yaml.safe_load((REPO / "params.yaml").read_text())
_KEYS = [(s, k) for s, section in _BASE.items() for k in section]
yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats()
    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


@FUZZ
@given(key=st.sampled_from(_KEYS), value=yaml_values)
def test_generated_values_for_every_key(tmp_path_factory, key, value):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params[key[0]][key[1]] = value
    f = _params(tmp_path_factory.mktemp("params"), yaml.safe_dump(params))
    old = os.getcwd()
    os.chdir(REPO)  # relative paths in params.yaml are the repo's
    try:
        attempt("params.yaml", f"generated value of {key[0]}.{key[1]}", lambda: load_config(f))
    finally:
        os.chdir(old)


# ----------------------------------------------------------------------------- the target


def _edit_json(name, fn):
    def edit(d: Path):
        c = json.loads((d / name).read_text())
        fn(c)
        (d / name).write_text(json.dumps(c))
    return edit


TARGETS = {
    "config not json": (lambda d: (d / "config.json").write_text("{"), "config.json"),
    "config missing": (lambda d: (d / "config.json").unlink(), "config.json"),
    "config without layers": (_edit_json("config.json", lambda c: c.pop("num_hidden_layers")),
                              "config.json"),
    "unknown model type": (_edit_json("config.json", lambda c: c.update(model_type="nope")),
                           "config.json"),
    "tokenizer not json": (lambda d: (d / "tokenizer.json").write_text("{"), "tokenizer"),
    "tokenizer files missing": (lambda d: [f.unlink() for f in d.glob("tokenizer*")], None),
    "no chat template": (lambda d: (d / "chat_template.jinja").unlink(), "chat template"),
    "template syntax error": (lambda d: (d / "chat_template.jinja").write_text("{% if %}"),
                              "chat template"),
    "template raises": (lambda d: (d / "chat_template.jinja").write_text(
        "{{ raise_exception('unsupported') }}"), "chat template"),
    "template ignores the conversation": (
        lambda d: (d / "chat_template.jinja").write_text("hello"), None),
    "weights truncated": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:100]), "model.safetensors"),
    "pickled weights only": (lambda d: (d / "model.safetensors").rename(d / "model.bin"),
                             "safetensors"),
}


@pytest.mark.parametrize("case", list(TARGETS))
def test_a_broken_target_directory_is_named(case, toy_target, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(toy_target / "model", model)
    TARGETS[case][0](model)
    out = tmp_path / "target"
    outcome, _ = attempt("target model directory", case,
                         lambda: target.resolve(TargetConfig(model=str(model)), out),
                         outputs=[out], named=TARGETS[case][1])
    assert outcome == "clear"


# ----------------------------------------------------------------------------- drafters


@pytest.mark.parametrize("made,asked", [(("offline", "hf"), "online"),
                                        (("online", "vllm"), "offline"),
                                        (("online", "hf"), "online")])
def test_train_refuses_hidden_states_made_another_way(toy_target, toy_data, tmp_path, made,
                                                      asked):
    """hidden.mode (or, online, hidden.engine) changed and the hidden stage not rerun, as when
    stages run by hand rather than by `dvc repro`: train follows the artifact, so it would
    train the other way without a word. It refuses, before loading anything."""
    from draftsmith import train
    from draftsmith.config import HiddenConfig, TrainConfig
    from draftsmith.hidden_format import HIDDEN_MANIFEST, online_manifest

    h = toy_data / "hidden"
    if made[0] == "online":
        h = tmp_path / "hidden"
        h.mkdir()
        (h / HIDDEN_MANIFEST).write_text(json.dumps(online_manifest([1, 2, 3], 64, made[1])))
    out = tmp_path / "drafter"
    outcome, error = attempt(
        "hidden artifact", f"made {made[0]} ({made[1]}), params say {asked} (vllm)",
        lambda: train.run(TrainConfig(steps=2), toy_target, h, toy_data / "vocab", out,
                          tmp_path / "ckpt", tokenized_dir=toy_data / "tok",
                          hidden=HiddenConfig(mode=asked, engine="vllm")),
        outputs=[out], named="hidden.mode")
    assert outcome == "clear" and "rerun the hidden stage" in error.fix


@pytest.fixture(scope="module")
def drafter_files(toy_target, toy_data, tmp_path_factory):
    """A trained drafter (a few steps) and its export, to break."""
    from draftsmith import train
    from draftsmith.config import ExportConfig, TrainConfig

    d = tmp_path_factory.mktemp("drafter")
    train.run(TrainConfig(steps=2, seq_len=256, batch_size=2, eval_samples=4, num_workers=0,
                          save_every=0), toy_target, toy_data / "hidden", toy_data / "vocab",
              d / "drafter", d / "ckpt")
    export.run(ExportConfig(), toy_target, d / "drafter", d / "export")
    return d


def _cfg(d, fn):
    c = json.loads((d / "config.json").read_text())
    fn(c)
    (d / "config.json").write_text(json.dumps(c))


EXPORTS = {
    "config not json": lambda d: (d / "config.json").write_text("{bad"),
    "config a list": lambda d: (d / "config.json").write_text("[1]"),
    "weights truncated": lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:500]),
    "weights not safetensors": lambda d: (d / "model.safetensors").write_bytes(b"PK\x03\x04"),
    "weights missing": lambda d: (d / "model.safetensors").unlink(),
    "architecture unknown": lambda d: _cfg(d, lambda c: c.update(architectures=["Foo"])),
    "size a string": lambda d: _cfg(d, lambda c: c.update(hidden_size="64")),
    "section a string": lambda d: _cfg(d, lambda c: c.update(eagle_config="x")),
    "layer ids a string": lambda d: _cfg(d, lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids="2,3,4")),
    "engine unknown": lambda d: _cfg(d, lambda c: c["draftsmith"].update(engine="trt")),
    "heads null": lambda d: _cfg(d, lambda c: c.update(num_attention_heads=None)),
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_a_broken_export_handed_to_validate_is_named(case, drafter_files, toy_target,
                                                     tmp_path):
    from draftsmith.target_info import read_info

    bad = tmp_path / "export"
    shutil.copytree(drafter_files / "export/vllm", bad)
    EXPORTS[case](bad)
    info = read_info(toy_target)
    outcome, err = attempt(
        "exported drafter (draftsmith validate)", case,
        lambda: export.validate(bad, target_num_layers=info.num_layers,
                                target_hidden_size=info.hidden_size,
                                target_vocab_size=info.vocab_size),
        kept=[bad], named=str(bad))
    assert outcome == "clear"


@FUZZ
@given(drop=st.lists(st.sampled_from(["hidden_size", "eagle_config", "draftsmith", "vocab_size",
                                      "intermediate_size", "architectures", "head_dim",
                                      "num_key_value_heads", "draft_vocab_size",
                                      "target_hidden_size", "num_attention_heads"]),
                     max_size=3, unique=True),
       set_to=st.dictionaries(st.sampled_from(["hidden_size", "eagle_config", "head_dim",
                                               "num_attention_heads", "vocab_size"]),
                              yaml_values, max_size=2))
def test_generated_damage_to_an_export_config(drafter_files, toy_target, tmp_path_factory,
                                              drop, set_to):
    from draftsmith.target_info import read_info

    bad = tmp_path_factory.mktemp("export")
    shutil.copytree(drafter_files / "export/vllm", bad, dirs_exist_ok=True)
    _cfg(bad, lambda c: [c.pop(k, None) for k in drop] and None or c.update(set_to))
    info = read_info(toy_target)
    attempt("exported drafter (draftsmith validate)", "generated config damage",
            lambda: export.validate(bad, target_num_layers=info.num_layers,
                                    target_hidden_size=info.hidden_size,
                                    target_vocab_size=info.vocab_size), kept=[bad])


INITS = {
    "empty folder": (lambda d: [f.unlink() for f in d.iterdir()], "no .safetensors"),
    "weights garbage": (lambda d: (d / "model.safetensors").write_bytes(b"x" * 64),
                        "model.safetensors"),
    "another target's vocab": (lambda d: _retensor(d, "t2d", lambda t: t[:10]), "vocab"),
    "a layer of another shape": (lambda d: _retensor(d, "fc.weight", lambda t: t[:, :-1]),
                                 "fc.weight"),
}


def _retensor(d: Path, name: str, fn):
    from safetensors.torch import load_file, save_file

    t = load_file(d / "model.safetensors")
    t[name] = fn(t[name]).contiguous()
    save_file(t, d / "model.safetensors")


@pytest.mark.parametrize("case", list(INITS))
def test_a_broken_drafter_to_fine_tune_is_named(case, drafter_files, tmp_path):
    init = tmp_path / "init"
    shutil.copytree(drafter_files / "export/vllm", init)
    INITS[case][0](init)
    model = load_drafter(drafter_files / "drafter")
    outcome, _ = attempt("drafter to fine-tune (train.init)", case,
                         lambda: load_drafter_weights(model, init), named=INITS[case][1])
    assert outcome == "clear"


DRAFTERS = {
    "drafter.json not json": lambda d: (d / "drafter.json").write_text("{"),
    "drafter.json missing keys": lambda d: (d / "drafter.json").write_text('{"hidden_size": 2}'),
    "unknown method": lambda d: _json_set(d / "drafter.json", method="medusa"),
    "weights garbage": lambda d: (d / "drafter.safetensors").write_bytes(b"xx"),
}


def _json_set(f: Path, **kw):
    f.write_text(json.dumps({**json.loads(f.read_text()), **kw}))


@pytest.mark.parametrize("case", list(DRAFTERS))
def test_a_broken_drafter_artifact_is_named(case, drafter_files, toy_target, tmp_path):
    """What export and benchmark read (models/drafter), broken: named, and the export it
    would have made not written."""
    from draftsmith.config import ExportConfig

    d = tmp_path / "drafter"
    shutil.copytree(drafter_files / "drafter", d)
    DRAFTERS[case](d)
    out = tmp_path / "export"
    outcome, _ = attempt("trained drafter (models/drafter)", case,
                         lambda: export.run(ExportConfig(), toy_target, d, out),
                         outputs=[out], named="drafter")
    assert outcome == "clear"


# ----------------------------------------------------------------------------- servers


ANSWERS = {  # what a "server" answers at /v1/models and /v1/chat/completions
    "a web page": (b"<html>hello</html>", b"<html>hello</html>", 200),
    "two models": (b'{"data": [{"id": "a"}, {"id": "b"}]}', b"{}", 200),
    "models not a list": (b'{"data": 5}', b"{}", 200),
    "answer not json": (b'{"data": [{"id": "t"}]}', b"{truncated", 200),
    "answer without choices": (b'{"data": [{"id": "t"}]}', b'{"id": 1}', 200),
    "empty choices": (b'{"data": [{"id": "t"}]}', b'{"choices": []}', 200),
    "content a number": (b'{"data": [{"id": "t"}]}',
                         b'{"choices": [{"message": {"content": 5}}]}', 200),
    "usage garbage": (b'{"data": [{"id": "t"}]}', b'{"choices": [{"message": {"content": "x"},'
                      b' "finish_reason": "stop"}], "usage": {"completion_tokens": "many"}}', 200),
    "always 404": (b"not found", b"not found", 404),
}


class _Answers(ThreadingHTTPServer):
    daemon_threads = True


def _serve(models: bytes, chat: bytes, status: int):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _reply(self, body):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._reply(models)

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._reply(chat)

    server = _Answers(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("case", list(ANSWERS))
def test_a_server_that_answers_garbage_is_named(case, toy_target, tmp_path):
    server = _serve(*ANSWERS[case])
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        cfg = GenerateConfig(num_samples=3, max_new_tokens=8, backend="openai")
        scfg = ServerConfig(urls=[url], max_retries=1, backoff_s=0.0, concurrency=2,
                            request_timeout_s=10)
        out = tmp_path / "raw"
        outcome, _ = attempt("server answers", case,
                             lambda: generate.run(cfg, toy_target, out, scfg, tmp_path / "w"),
                             outputs=[out], named=url.rsplit("/", 1)[0])
        assert outcome == "clear" or case == "usage garbage"  # tokens unknown: counted as 0
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_without_counters_is_named():
    from draftsmith.serving.acceptance import Counters

    server = _serve(b"# not prometheus\nfoo bar baz\nvllm:x NaNish\n", b"", 200)
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        attempt("server counters (/metrics)", "garbage page", lambda: Counters.scrape(url, 3))
        server.shutdown()
        server.server_close()
        outcome, _ = attempt("server counters (/metrics)", "server gone",
                             lambda: Counters.scrape(url, 3), named="/metrics")
        assert outcome == "clear"
    finally:
        server.server_close()


# ----------------------------------------------------------------------------- environment


def test_a_bad_kernel_mode_in_the_environment_is_named(monkeypatch):
    from draftsmith_kernels import _build

    monkeypatch.setenv("DRAFTSMITH_KERNELS", "fastest")
    outcome, err = attempt("environment variable", "DRAFTSMITH_KERNELS=fastest",
                           _build.current_mode, named="DRAFTSMITH_KERNELS")
    assert outcome == "clear" and "ref" in err.fix
