"""Chat formats: how a model writes its reasoning and answer when it generates.

A chat template says how a conversation is *rendered*; a format says what the model *emits*
after the generation prompt: the text before its reasoning, the text between reasoning and
answer, and the token that ends its turn. Training text must be exactly what the target emits,
so the tokenize stage checks every sample against the format (and the format against the
template). The seed story's bug, reasoning and answer joined without the wrapper, fails that
check.

Where a format comes from (`target.chat_format`):
- `auto` (default): read from the template itself (`chat_probe.probe_format` renders conversations
  with sentinel reasoning and answer and reads where they land), with the registry below only
  for templates the probe cannot read (DeepSeek-R1 drops reasoning and has no thinking switch);
- a registry name, to force one;
- a mapping in params.yaml, for a template that renders no reasoning at all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class ChatFormat:
    name: str
    end_of_turn: str  # the stop token the model ends its turn with (one token)
    reasoning_open: str | None = None  # before the reasoning, e.g. "<think>\n"; None: no reasoning
    reasoning_close: str | None = None  # between reasoning and answer, e.g. "\n</think>\n\n"
    # DeepSeek-R1/V3.1 put the opening in the generation prompt, so the model's own output
    # starts inside the reasoning; Qwen3 emits the opening itself.
    prompt_opens_reasoning: bool = False
    answer_open: str = ""  # before the answer when thinking is off (a harmony "final" channel)
    # None: the template renders the final turn's reasoning as the model emitted it. A string:
    # the template drops that reasoning and writes this before the answer instead (R1: "",
    # V3.1: "</think>"), so the template check compares the answer part alone.
    template_answer_prefix: str | None = None
    source: str = "registry"  # registry | template (probed) | params

    @property
    def supports_reasoning(self) -> bool:
        return self.reasoning_open is not None

    @property
    def open_tag(self) -> str:
        """The opening without trailing whitespace: what a server's reasoning parser strips."""
        return (self.reasoning_open or "").rstrip()

    @property
    def close_tag(self) -> str:
        return (self.reasoning_close or "").strip()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ChatFormat:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

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
            text = self.answer_open + content.lstrip("\n")
        else:
            head = "" if self.prompt_opens_reasoning else self.reasoning_open
            if not think_closed:
                return head + reasoning
            text = f"{head}{reasoning}{self.reasoning_close}{content.lstrip(chr(10))}"
        return text + self.end_of_turn if finished else text

    def parse(self, completion: str, *, thinking: bool) -> tuple[str | None, str, bool, bool]:
        """Split a raw completion (special tokens kept) into (reasoning, content, think_closed,
        finished). The inverse of `emission` on well-formed text."""
        finished = completion.endswith(self.end_of_turn)
        body = completion[: -len(self.end_of_turn)] if finished else completion
        if not thinking or not self.supports_reasoning:
            return None, body.removeprefix(self.answer_open), True, finished
        if not self.prompt_opens_reasoning:
            if not body.startswith(self.open_tag):
                return None, body, False, finished
            body = body[len(self.open_tag):]
        if self.close_tag not in body:
            return body.strip("\n"), "", False, finished
        reasoning, content = body.split(self.close_tag, 1)
        after = self.reasoning_close[self.reasoning_close.index(self.close_tag) + len(self.close_tag):]
        return reasoning.strip("\n"), content.removeprefix(after), True, finished

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


def assistant_message(reasoning: str | None, content: str) -> dict:
    """An assistant turn as chat templates read it: reasoning under the names the families use
    (Qwen3, GLM, Kimi: reasoning_content; gpt-oss: thinking; some: reasoning)."""
    turn = {"role": "assistant", "content": content}
    if reasoning is not None:
        turn.update(reasoning_content=reasoning, thinking=reasoning, reasoning=reasoning)
    return turn


# Named formats: for overrides, for templates the probe cannot read, and to name a probed
# format that equals one of them. Markers pick an entry when the probe finds no reasoning.
FORMATS = {
    f.name: f
    for f in (
        ChatFormat("qwen3", "<|im_end|>", "<think>\n", "\n</think>\n\n"),
        ChatFormat("deepseek-r1", "<｜end▁of▁sentence｜>", "<think>\n", "\n</think>\n\n",
                   prompt_opens_reasoning=True, template_answer_prefix=""),
        ChatFormat("chatml", "<|im_end|>"),
        ChatFormat("llama3", "<|eot_id|>"),
    )
}
MARKERS = {"qwen3": ("<|im_start|>", "<think>"), "deepseek-r1": ("<｜Assistant｜>",),
           "chatml": ("<|im_start|>",), "llama3": ("<|start_header_id|>",)}


def by_markers(chat_template: str) -> ChatFormat | None:
    for name, markers in MARKERS.items():  # ordered: qwen3 before plain chatml
        if all(m in chat_template for m in markers):
            return FORMATS[name]
    return None


def named(fmt: ChatFormat) -> ChatFormat:
    """A probed format under its registry name when it is one of them."""
    for known in FORMATS.values():
        if asdict(known) | {"source": fmt.source} == asdict(fmt) | {"name": known.name}:
            return ChatFormat.from_dict(asdict(fmt) | {"name": known.name})
    return fmt
