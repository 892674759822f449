"""Reference tests for the registry's families: the toy's, Qwen3's, DeepSeek-R1's and a template
without reasoning support; plus the seed story's bug, which the format check must catch. Other
families, read from their templates alone, are in test_chat_templates.py."""

from pathlib import Path

import pytest

from draftsmith.chat_format import FORMATS
from draftsmith.chat_probe import probe_format, resolve_format
from draftsmith.config import ChatFormatSpec
from draftsmith.errors import DraftsmithError
from draftsmith.render import render_sample
from draftsmith.toy.tokenizer import CHAT_TEMPLATE, train_tokenizer

TEMPLATES = Path(__file__).parent / "templates"
USER = [{"role": "user", "content": "What is 12 + 30?"}]
REASONING = "2 + 0 = 2\n1 + 3 = 4"
ANSWER = "42"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["What is 12 + 30? 2 + 0 = 2 answer 42"] * 10, vocab_size=300)


def with_template(tok, name):
    tok.chat_template = CHAT_TEMPLATE if name == "toy" else (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def record(fmt, *, thinking=True, reasoning=REASONING, content=ANSWER, messages=USER,
           completion="emitted", finish_reason="stop"):
    rec = dict(id="x", messages=messages, thinking=thinking, reasoning=reasoning, content=content,
               finish_reason=finish_reason, think_closed=True)
    # The raw completion the target emitted, as the in-process backend keeps it.
    rec["completion"] = (fmt.emission(reasoning, content, thinking=thinking)
                         if completion == "emitted" else completion)
    return rec


@pytest.mark.parametrize("name, fmt, thinking", [
    ("toy", "qwen3", True), ("toy", "qwen3", False),
    ("qwen3", "qwen3", True), ("qwen3", "qwen3", False),
    ("chatml", "chatml", False),
])
def test_template_renders_what_the_model_emits(tokenizer, name, fmt, thinking):
    tok = with_template(tokenizer, name)
    f = probe_format(tok)
    assert f.name == fmt
    rec = record(f, thinking=thinking, reasoning=REASONING if thinking else None)
    r = render_sample(tok, f, rec)
    assert r.problems == []
    if thinking:
        assert r.response == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}<|im_end|>"
        assert r.prompt.endswith("<|im_start|>assistant\n")
    else:
        assert r.response == f"{ANSWER}<|im_end|>"
        if fmt == "qwen3":  # thinking off: the empty think block is part of the prompt
            assert r.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_multi_turn_history_is_consistent(tokenizer):
    """Qwen3 drops reasoning from earlier turns; the prompt and the full render agree on it, so
    the last turn (the one trained on) checks clean."""
    tok = with_template(tokenizer, "qwen3")
    history = [*USER, {"role": "assistant", "content": "42", "reasoning_content": "old"},
               {"role": "user", "content": "And 1 + 1?"}]
    rec = record(FORMATS["qwen3"], messages=history, reasoning="1 + 1 = 2", content="2")
    r = render_sample(tok, FORMATS["qwen3"], rec)
    assert r.problems == [] and "old" not in r.prompt


def test_deepseek_r1_prompt_opens_the_think_block():
    tok = train_tokenizer(["What is 12 + 30? 2 + 0 = 2 answer 42"] * 10, vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": [
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]})
    tok = with_template(tok, "deepseek_r1")
    f = probe_format(tok)
    assert f.name == "deepseek-r1"
    rec = record(f)
    r = render_sample(tok, f, rec)
    assert r.prompt.endswith("<｜Assistant｜><think>\n")
    assert r.response == f"{REASONING}\n</think>\n\n{ANSWER}<｜end▁of▁sentence｜>"
    # R1's template re-renders the turn without "<think>\n" and without the reasoning; the
    # check compares the answer it keeps (the wrapper is checked against the raw completion).
    assert r.problems == []
    wrong = record(f, content="41")
    wrong["content"] = ANSWER  # the raw completion says 41: the stored answer was changed
    assert render_sample(tok, f, wrong).problems == ["emission_mismatch"]


def test_template_without_reasoning_rejects_reasoning(tokenizer):
    tok = with_template(tokenizer, "chatml")
    with pytest.raises(DraftsmithError, match="no reasoning support"):
        render_sample(tok, FORMATS["chatml"], record(FORMATS["chatml"], completion=None))


def test_seed_story_bug_template_fails_the_check(tokenizer):
    """Reasoning and answer joined without the model's thinking tokens."""
    tok = with_template(tokenizer, "seed_story_bug")
    r = render_sample(tok, FORMATS["qwen3"], record(FORMATS["qwen3"]))
    assert "template_turn_mismatch" in r.problems


def test_seed_story_bug_in_the_data_fails_the_check(tokenizer):
    """A generator that stored reasoning+answer as the content, wrapper dropped."""
    tok = with_template(tokenizer, "toy")
    f = FORMATS["qwen3"]
    good = f.emission(REASONING, ANSWER, thinking=True)
    rec = record(f, reasoning=None, content=REASONING + ANSWER, completion=good)
    assert "emission_mismatch" in render_sample(tok, f, rec).problems


def test_empty_think_block_the_model_never_emitted_fails(tokenizer):
    """Thinking recorded as on, but the model answered directly (e.g. a server with thinking
    off): the template would train on an empty think block the model never produced."""
    tok = with_template(tokenizer, "qwen3")
    f = FORMATS["qwen3"]
    rec = record(f, reasoning=None, completion=f"{ANSWER}<|im_end|>")
    assert render_sample(tok, f, rec).problems == ["emission_mismatch"]


@pytest.mark.parametrize("fmt", ["qwen3", "deepseek-r1"])
def test_parse_inverts_emission(fmt):
    f = FORMATS[fmt]
    text = f.emission(REASONING, ANSWER, thinking=True)
    assert f.parse(text, thinking=True) == (REASONING, ANSWER, True, True)
    cut = f.emission(REASONING, "", thinking=True, finished=False, think_closed=False)
    assert f.parse(cut, thinking=True) == (REASONING, "", False, False)


def test_template_without_a_stop_token_asks_for_chat_format(tokenizer):
    tok = with_template(tokenizer, "qwen3")
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(DraftsmithError, match="which token ends the model's turn") as err:
        probe_format(tok)
    assert "target.chat_format" in str(err.value)


def test_declared_format_is_used_and_checked(tokenizer):
    tok = with_template(tokenizer, "chatml")  # renders no reasoning: the probe cannot find it
    assert not probe_format(tok).supports_reasoning
    spec = ChatFormatSpec(reasoning_open="<think>\n", reasoning_close="\n</think>\n\n",
                          end_of_turn="<|im_end|>", template_answer_prefix="")
    f = resolve_format(spec, tok)
    assert f.source == "params" and f.supports_reasoning
    r = render_sample(tok, f, record(f))
    assert r.problems == [] and r.response.startswith("<think>\n")
    with pytest.raises(DraftsmithError, match="not one token"):
        resolve_format(spec.model_copy(update={"end_of_turn": "<|eot|>"}), tok)


@pytest.mark.parametrize("bad, match", [
    (dict(reasoning_open="<think>", end_of_turn="<|im_end|>"), "go together"),
    (dict(reasoning_open="<think>", reasoning_close="\n", end_of_turn="<|im_end|>"),
     "only whitespace"),
    (dict(reasoning_open="<think>", reasoning_close="</think>"), "end_of_turn"),
    (dict(end_of_turn="<|im_end|>", think="<think>"), "think"),
])
def test_declared_format_is_validated(tmp_path, bad, match):
    import yaml

    from draftsmith.config import load_config
    from draftsmith.errors import ConfigError

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"target": {"chat_format": bad}}))
    with pytest.raises(ConfigError, match=match) as err:
        load_config(params)
    print(err.value)