"""Chat-format registry: how each model family writes its reasoning when it generates.

A chat template says how a conversation is *rendered*; a format says what the model *emits*
after the generation prompt: the thinking wrapper, its separators and the end-of-turn token.
Training text must be exactly what the target emits, so the tokenize stage checks the
template's rendering against the format (and against the raw completion when the backend kept
it). The seed story's bug, reasoning and answer joined without the wrapper, fails that check.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class ChatFormat:
    name: str
    end_of_turn: str
    think_open: str | None = None  # None: the family has no reasoning support
    think_close: str | None = None
    # DeepSeek-R1 puts "<think>\n" in the generation prompt, so the model's own output starts
    # inside the reasoning; Qwen3 emits the opening tag itself.
    prompt_opens_think: bool = False
    # Qwen3 with thinking off: the generation prompt carries an empty think block.
    empty_think_when_off: bool = False
    template_markers: tuple[str, ...] = ()

    @property
    def supports_reasoning(self) -> bool:
        return self.think_open is not None

    def emission(self, reasoning: str | None, content: str, *, thinking: bool,
                 finished: bool = True, think_closed: bool = True) -> str:
        """The exact text the model emits after the generation prompt.

        `finished=False` (truncated at max_new_tokens) leaves off the end-of-turn token;
        `think_closed=False` means generation stopped inside the reasoning."""
        reasoning = (reasoning or "").strip("\n")
        if not thinking or not self.supports_reasoning:
            if reasoning:
                raise DraftsmithError(
                    f"a sample carries reasoning but the {self.name} format "
                    f"{'has no reasoning support' if not self.supports_reasoning else 'was run with thinking off'}",
                    "set generate.thinking to match the data, or pick the target's chat format "
                    "with target.chat_format",
                )
            text = content
        else:
            head = "" if self.prompt_opens_think else f"{self.think_open}\n"
            if not think_closed:
                return head + reasoning
            text = f"{head}{reasoning}\n{self.think_close}\n\n{content.lstrip(chr(10))}"
        return text + self.end_of_turn if finished else text

    def parse(self, completion: str, *, thinking: bool) -> tuple[str | None, str, bool, bool]:
        """Split a raw completion (special tokens kept) into (reasoning, content, think_closed,
        finished). The inverse of `emission` on well-formed text."""
        finished = completion.endswith(self.end_of_turn)
        body = completion[: -len(self.end_of_turn)] if finished else completion
        if not thinking or not self.supports_reasoning:
            return None, body, True, finished
        if not self.prompt_opens_think:
            if not body.startswith(self.think_open):
                return None, body, False, finished
            body = body[len(self.think_open):]
        if self.think_close not in body:
            return body.strip("\n"), "", False, finished
        reasoning, content = body.split(self.think_close, 1)
        return reasoning.strip("\n"), content.lstrip("\n"), True, finished


    def well_formed(self, completion: str, *, thinking: bool) -> bool:
        """Whether the model's raw output is in its own format (parse, rebuild, compare). A
        small or broken model can emit e.g. two closing tags; such samples are the model's
        fault, not the pipeline's, and are counted apart from the format check."""
        reasoning, content, closed, finished = self.parse(completion, thinking=thinking)
        try:
            rebuilt = self.emission(reasoning, content, thinking=thinking, finished=finished,
                                    think_closed=closed)
        except DraftsmithError:
            return False
        return rebuilt == completion and (closed or not finished)


FORMATS = {
    f.name: f
    for f in (
        ChatFormat("qwen3", "<|im_end|>", "<think>", "</think>", empty_think_when_off=True,
                   template_markers=("<|im_start|>", "<think>")),
        ChatFormat("deepseek-r1", "<｜end▁of▁sentence｜>", "<think>", "</think>",
                   prompt_opens_think=True, template_markers=("<｜Assistant｜>",)),
        ChatFormat("chatml", "<|im_end|>", template_markers=("<|im_start|>",)),
        ChatFormat("llama3", "<|eot_id|>", template_markers=("<|start_header_id|>",)),
    )
}


def detect_format(chat_template: str | None) -> ChatFormat:
    """Pick the registry entry whose markers all occur in the template (most specific first)."""
    if not chat_template:
        raise DraftsmithError(
            "the target's tokenizer has no chat template",
            "use an instruct/chat model, or set target.chat_format explicitly",
        )
    for fmt in FORMATS.values():  # ordered: qwen3 before plain chatml
        if all(m in chat_template for m in fmt.template_markers):
            return fmt
    raise DraftsmithError(
        "could not recognise the target's chat template",
        f"set target.chat_format to one of: {', '.join(FORMATS)} (or add an entry to "
        "draftsmith/chat_format.py with a reference test)",
    )


def get_format(name: str, chat_template: str | None) -> ChatFormat:
    return detect_format(chat_template) if name == "auto" else FORMATS[name]
