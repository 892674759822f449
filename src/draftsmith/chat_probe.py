"""Reading a chat format from the chat template itself.

The probe renders conversations whose question, reasoning and answer are sentinel strings, and
reads the format from where the sentinels land:
- thinking on, one turn: generation prompt P, full conversation P + open + R + close + A + end;
  the open is in P already when the prompt opens the reasoning (its thinking-off prompt lacks it);
- thinking off: what precedes the answer (a harmony "final" channel) and what follows it;
- a template that drops the final turn's reasoning (DeepSeek-V3.1) shows its markers through
  the thinking switch instead: P_on = base + open, P_off = base + close;
- the end of turn is the first special token after the answer, or, where the template writes
  none (GLM), the one the next turn starts with (two turns).
"""

from __future__ import annotations

from draftsmith.chat_format import FORMATS, ChatFormat, assistant_message, by_markers, named
from draftsmith.errors import DraftsmithError

REASONING, ANSWER, QUESTION = "Sentinel reasoning 7", "Sentinel answer 7", "Sentinel question 7"
_DECLARE = ("declare the format in params.yaml: target.chat_format: {reasoning_open: ..., "
            "reasoning_close: ..., end_of_turn: ...} (docs/chat-formats.md)")


def resolve_format(spec, tokenizer) -> ChatFormat:
    """The target's format from `target.chat_format`: "auto", a registry name or a mapping."""
    if isinstance(spec, str) and spec != "auto":
        fmt = FORMATS[spec]
    elif isinstance(spec, str):
        fmt = probe_format(tokenizer)
    else:
        fields = spec if isinstance(spec, dict) else spec.model_dump()
        fmt = ChatFormat(name="params", source="params", **fields)
    if fmt.end_of_turn not in tokenizer.get_vocab():
        raise DraftsmithError(
            f"the chat format's end of turn {fmt.end_of_turn!r} is not one token of the target's "
            "tokenizer, so generation could not stop on it",
            "set target.chat_format.end_of_turn to the token the model ends its turn with",
        )
    return fmt


def probe_format(tokenizer) -> ChatFormat:
    if not tokenizer.chat_template:
        raise DraftsmithError("the target's tokenizer has no chat template",
                              "use an instruct/chat model, or " + _DECLARE)
    user = [{"role": "user", "content": QUESTION}]

    def render(messages, generation_prompt: bool, thinking: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=generation_prompt,
                                                 enable_thinking=thinking)
        except Exception as exc:  # a template's own raise_exception, or a Jinja error
            raise DraftsmithError(f"the chat template failed on a plain conversation: {exc}",
                                  _DECLARE) from None

    p_on, p_off = render(user, True, True), render(user, True, False)
    f_on = render([*user, assistant_message(REASONING, ANSWER)], False, True)
    f_off = render([*user, assistant_message(None, ANSWER)], False, False)
    two = render([*user, assistant_message(REASONING, ANSWER), *user], True, True)

    if f_off.startswith(p_off) and ANSWER in f_off[len(p_off):]:
        answer_open, after = f_off[len(p_off):].split(ANSWER, 1)
    else:  # thinking off renders history unlike its prompt: such samples fail their own check
        answer_open, after = "", f_on.split(ANSWER, 1)[-1]
    end = _first_special(tokenizer, after) or _first_special(tokenizer, two.split(ANSWER, 1)[-1])
    if end is None:
        raise DraftsmithError("cannot tell which token ends the model's turn: no special token "
                              "follows the answer in the template's rendering", _DECLARE)
    common = dict(name="template", source="template", end_of_turn=end, answer_open=answer_open)

    if REASONING in f_on:
        return named(_from_rendered_reasoning(tokenizer, p_on, p_off, f_on, common))
    if p_on != p_off:
        fmt = _from_thinking_switch(tokenizer, p_on, p_off, f_on, common)
        if fmt is not None:
            return named(fmt)
    known = by_markers(tokenizer.chat_template)  # DeepSeek-R1: drops reasoning, no switch
    if known is not None and known.supports_reasoning:
        return known
    return named(ChatFormat(**common))  # the template has no place for reasoning


def _from_rendered_reasoning(tokenizer, p_on, p_off, f_on, common) -> ChatFormat:
    tail = f_on[len(p_on):] if f_on.startswith(p_on) else None
    if tail is None or f_on.count(REASONING) != 1 or not (
            0 <= tail.find(REASONING) < tail.find(ANSWER)):
        raise DraftsmithError("the chat template does not render the reasoning right after its "
                              "generation prompt and before the answer, so where the model "
                              "writes it cannot be read from the template", _DECLARE)
    i, j = tail.index(REASONING), tail.index(ANSWER)
    opening, closing = tail[:i], tail[i + len(REASONING):j]
    if not closing.strip():
        raise DraftsmithError(
            "the chat template joins reasoning and answer with no marker between them (the "
            "seed story's bug: a drafter trained on it learns text the model never emits)",
            "fix the template, or " + _DECLARE)
    prompt_opens = not opening.strip()
    if prompt_opens:  # the generation prompt holds the opening (its thinking-off one does not)
        opening = _split_prompts(tokenizer, p_on, p_off)[1] + opening
        if not opening.strip():
            raise DraftsmithError("the chat template renders reasoning with no opening marker",
                                  _DECLARE)
    return ChatFormat(reasoning_open=opening, reasoning_close=closing,
                      prompt_opens_reasoning=prompt_opens, **common)


def _from_thinking_switch(tokenizer, p_on, p_off, f_on, common) -> ChatFormat | None:
    base, on_extra, off_extra = _split_prompts(tokenizer, p_on, p_off)
    if not on_extra.strip() or not f_on.startswith(base) or ANSWER not in f_on[len(base):]:
        return None
    closing = off_extra[len(on_extra):] if off_extra.startswith(on_extra) else off_extra
    if not closing.strip():
        return None
    return ChatFormat(reasoning_open=on_extra, reasoning_close=closing, prompt_opens_reasoning=True,
                      template_answer_prefix=f_on[len(base):].split(ANSWER, 1)[0], **common)


def _split_prompts(tokenizer, p_on: str, p_off: str) -> tuple[str, str, str]:
    """(common base, the thinking-on prompt's rest, the thinking-off prompt's rest), split at a
    token boundary ("<think>" and "</think>" share a "<" that belongs to neither)."""
    on = tokenizer(p_on, add_special_tokens=False, return_offsets_mapping=True)
    off = tokenizer(p_off, add_special_tokens=False)["input_ids"]
    n = 0
    while n < min(len(on["input_ids"]), len(off)) and on["input_ids"][n] == off[n]:
        n += 1
    cut = on["offset_mapping"][n - 1][1] if n else 0
    if not p_off.startswith(p_on[:cut]):
        cut = 0
    return p_on[:cut], p_on[cut:], p_off[cut:]


def _first_special(tokenizer, text: str) -> str | None:
    special = set(tokenizer.all_special_tokens) | {
        t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    found = [(text.find(t), -len(t), t) for t in special if t and t in text]
    return min(found)[2] if found else None
