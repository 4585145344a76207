"""Chat-format prompts and tool turns: how a task's text becomes token ids for a given tokenizer.

With a tokenizer that has a chat template (an HF instruct checkpoint, `model.chat_template=true`), a
prompt is rendered as one user message with the generation prompt (verl's `raw_prompt` messages through
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


def render_prompt(hf_tokenizer: Any, text: str) -> str:
    """The chat template's text for one user message `text`, ending with the assistant generation prompt."""
    messages = [{"role": "user", "content": text}]
    return str(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


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
    return [int(i) for i in hf(render_prompt(hf, text), add_special_tokens=False)["input_ids"]]


def encode_tool_result(tokenizer: Tokenizer, result: str) -> list[int]:
    """Ids inserted after a tool call: the template's tool turn when the tokenizer uses one, else `result`."""
    hf = chat_template_of(tokenizer)
    if hf is None:
        return tokenizer.encode(result)
    return [int(i) for i in hf(render_tool_turn(hf, result), add_special_tokens=False)["input_ids"]]
