"""Rendering a sample into training text, and checking it against what the target emits.

Training text = the chat template's generation prompt + the target's own emission. The check
(see `format_problems`) proves, per sample, that this is what the target produces:
  1. the emission rebuilt from (reasoning, content) equals the raw completion, when kept;
  2. the chat template's rendering of the whole conversation starts with the same text
     (templates that drop reasoning, add an empty think block or concatenate fail here).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.chat_format import ChatFormat, assistant_message


def prompt_text(tokenizer, messages: list[dict], thinking: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )


def template_render(tokenizer, messages: list[dict], reasoning: str | None, content: str,
                    thinking: bool) -> str:
    return tokenizer.apply_chat_template(
        [*messages, assistant_message(reasoning, content)], tokenize=False, add_generation_prompt=False, enable_thinking=thinking
    )


@dataclass
class Rendered:
    prompt: str
    response: str  # exactly what the target emits after the prompt
    problems: list[str]


def render_sample(tokenizer, fmt: ChatFormat, record: dict, *, check_template: bool = True
                  ) -> Rendered:
    """Build prompt + response text for one raw record and list its format problems."""
    thinking = record["thinking"]
    finished = record["finish_reason"] == "stop"
    think_closed = record.get("think_closed", True)
    prompt = prompt_text(tokenizer, record["messages"], thinking)
    response = fmt.emission(record["reasoning"], record["content"], thinking=thinking,
                            finished=finished, think_closed=think_closed)
    return Rendered(prompt, response, format_problems(
        tokenizer, fmt, record, prompt, response, check_template=check_template and finished))


def format_problems(tokenizer, fmt: ChatFormat, record: dict, prompt: str, response: str, *,
                    check_template: bool) -> list[str]:
    problems = []
    raw = record.get("completion")
    if raw is not None and raw != response:
        problems.append("emission_mismatch")  # parsed fields do not rebuild what was emitted
    if check_template:
        full = template_render(tokenizer, record["messages"], record["reasoning"],
                               record["content"], record["thinking"])
        if record["thinking"] and fmt.template_answer_prefix is not None:
            # The template drops the final turn's reasoning (DeepSeek-R1/V3.1): compare what it
            # keeps, the prompt before the opening and the answer after its own prefix; the
            # reasoning wrapper itself is checked against the raw completion above.
            prompt = prompt.removesuffix(fmt.reasoning_open)
            response = (fmt.template_answer_prefix + record["content"].lstrip("\n")
                        + fmt.end_of_turn)
        if not full.startswith(prompt):
            problems.append("template_prompt_mismatch")  # history re-rendered differently
        elif not _same_turn(full[len(prompt):], response, fmt.end_of_turn):
            problems.append("template_turn_mismatch")  # the turn differs from the emission
    return problems


def _same_turn(rendered: str, emitted: str, end_of_turn: str) -> bool:
    """The template's turn is the emission, up to trailing whitespace. A template may leave the
    end-of-turn token to the next turn's opener (GLM ends a turn with "<|user|>")."""
    if rendered.startswith(emitted):
        return not rendered[len(emitted):].strip()
    return (emitted.endswith(end_of_turn) and end_of_turn not in rendered
            and rendered.rstrip() == emitted[: -len(end_of_turn)].rstrip())
