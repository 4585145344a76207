"""Chat-format prompts and tool turns: how a task's text becomes token ids for a given tokenizer.

With a tokenizer that has a chat template (an HF instruct checkpoint, `model.chat_template=true`), a
prompt is rendered as one user message (after `model.system_prompt` as the system turn, when set) with
the generation prompt (verl's `raw_prompt` messages through
`apply_chat_template(..., add_generation_prompt=True)`, then tokenized without added specials), and a
tool result is inserted the way the template renders a `tool` message after the assistant's turn. Any
other tokenizer (the char tokenizer, or chat templates turned off) gets bos + text and the bare result.
"""

from __future__ import annotations

from typing import Any

from rollstream.model.tokenizer import Tokenizer

#: Stands for the assistant's (cut) tool-call turn while rendering what follows it.
_CALL_MARKER = "ROLLSTREAM_TOOL_CALL_MARKER"


def chat_template_of(tokenizer: Tokenizer) -> Any | None:
    """The HF tokenizer whose chat template `tokenizer` renders prompts with, or None."""
    if getattr(tokenizer, "use_chat_template", False):
        return getattr(tokenizer, "hf", None)
    return None


def render_prompt(hf_tokenizer: Any, text: str, system: str | None = None) -> str:
    """The chat template's text for one user message `text` (after a `system` turn when given, else the
    template's default one, if any), ending with the assistant generation prompt."""
    messages = [{"role": "user", "content": text}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return str(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def check_system_prompt(hf_tokenizer: Any, system: str) -> None:
    """ValueError naming model.system_prompt when the tokenizer's chat template does not render it."""
    if system not in render_prompt(hf_tokenizer, "q", system):
        raise ValueError(
            f"model.system_prompt={system!r}: the tokenizer's chat template does not render a system message"
        )


def render_tool_turn(hf_tokenizer: Any, result: str) -> str:
    """The text the template puts after an assistant turn: its end, a `tool` message holding `result`,
    and the next assistant generation prompt. ValueError when the template drops tool messages."""
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": _CALL_MARKER},
        {"role": "tool", "content": result},
    ]
    full = str(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    at = full.rfind(_CALL_MARKER)
    tail = full[at + len(_CALL_MARKER) :] if at >= 0 else ""
    if at < 0 or result not in tail:
        raise ValueError(
            "the tokenizer's chat template does not render a tool message after an assistant turn"
        )
    return tail


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Prompt ids: the chat-template rendering when the tokenizer uses one, else bos + `text`."""
    hf = chat_template_of(tokenizer)
    if hf is None:
        return tokenizer.encode(text, add_bos=True)
    text = render_prompt(hf, text, getattr(tokenizer, "system_prompt", None))
    return [int(i) for i in hf(text, add_special_tokens=False)["input_ids"]]


def encode_tool_result(tokenizer: Tokenizer, result: str) -> list[int]:
    """Ids inserted after a tool call: the template's tool turn when the tokenizer uses one, else `result`."""
    hf = chat_template_of(tokenizer)
    if hf is None:
        return tokenizer.encode(result)
    return [int(i) for i in hf(render_tool_turn(hf, result), add_special_tokens=False)["input_ids"]]
