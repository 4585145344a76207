"""Tokenizers: the `Tokenizer` protocol and the character-level tokenizer of the built-in tasks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
CHARS: str = "0123456789+-*/=()<>?:.,; " + "abcdefghijklmnopqrstuvwxyz" + "[]|"


@runtime_checkable
class Tokenizer(Protocol):
    """What the producer and trainer need from a tokenizer (char-level or a wrapped HF one)."""

    @property
    def pad_id(self) -> int:
        """Id of the padding token."""
        ...

    @property
    def bos_id(self) -> int | None:
        """Id of the beginning-of-sequence token, or None when the tokenizer has none."""
        ...

    @property
    def eos_id(self) -> int:
        """Id of the end-of-sequence token (generation stops after it)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of token ids (embedding rows needed)."""
        ...

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`, with the bos id first when `add_bos`."""
        ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`, dropping special tokens when `skip_special`."""
        ...


class CharTokenizer:
    """Character-level tokenizer: pad=0, bos=1, eos=2, then one id per character of `CHARS`."""

    def __init__(self, chars: str = CHARS) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer characters must be unique")
        self.chars = chars
        self._stoi = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}
        self._itos = {i: c for c, i in self._stoi.items()}

    @property
    def pad_id(self) -> int:
        """Id of the padding token (0)."""
        return 0

    @property
    def bos_id(self) -> int:
        """Id of the beginning-of-sequence token (1)."""
        return 1

    @property
    def eos_id(self) -> int:
        """Id of the end-of-sequence token (2)."""
        return 2

    @property
    def vocab_size(self) -> int:
        """Special tokens plus one id per character."""
        return len(SPECIAL_TOKENS) + len(self.chars)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Ids of the characters of `text`; an unknown character raises ValueError naming it."""
        ids = [self.bos_id] if add_bos else []
        for pos, ch in enumerate(text):
            tid = self._stoi.get(ch)
            if tid is None:
                raise ValueError(f"CharTokenizer: unknown character {ch!r} at position {pos} in {text!r}")
            ids.append(tid)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are dropped when `skip_special`, else written as `<pad>` etc."""
        out: list[str] = []
        for tid in ids:
            tid = int(tid)
            if tid < len(SPECIAL_TOKENS):
                if not skip_special:
                    out.append(SPECIAL_TOKENS[tid])
                continue
            ch = self._itos.get(tid)
            if ch is None:
                raise ValueError(f"CharTokenizer: unknown token id {tid}")
            out.append(ch)
        return "".join(out)
