"""Prompt sources: seeded task generator or JSONL file, with epochs, a held-out split, shards and a cursor."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rollstream.tasks.base import Prompt, Task, check_vocab, content_uid, holdout_key

Cursor = tuple[int, int]


class PromptSource:
    """Iterator of ``(epoch, index_in_epoch, Prompt)``: over a fixed training set reshuffled each epoch, or
    (``fresh_from_task``) a new prompt drawn for every position, seeded by (seed, epoch, index)."""

    def __init__(
        self,
        prompts: Sequence[Prompt],
        val: Sequence[Prompt] = (),
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
    ) -> None:
        """Build from explicit training and validation prompts (uids unique, the two sets disjoint)."""
        self._train: tuple[Prompt, ...] = tuple(prompts)
        self._val: tuple[Prompt, ...] = tuple(val)
        if not self._train:
            raise ValueError("prompt source has no training prompts")
        if num_epochs is not None and num_epochs < 0:
            raise ValueError(f"num_epochs must be >= 0 or None, got {num_epochs}")
        _check_unique(self._train, "training")
        _check_unique(self._val, "validation")
        val_uids = {p.uid for p in self._val}
        val_texts = {holdout_key(p) for p in self._val}
        for p in self._train:
            if p.uid in val_uids or holdout_key(p) in val_texts:
                raise ValueError(f"training prompt {p.uid} ({p.text!r}) also appears in the validation set")
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.shard_index = 0
        self.shard_count = 1
        self._epoch = 0
        self._pos = 0
        self._order_epoch = -1
        self._order: list[int] = []
        self._size = len(self._train)  # positions per epoch
        self._fresh: Task | None = None  # set by fresh_from_task: draw prompts instead of indexing _train
        self._val_texts = val_texts

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_task(
        cls,
        task: Task,
        *,
        seed: int = 0,
        epoch_size: int = 1024,
        val_size: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        val_seed: int | None = None,
    ) -> PromptSource:
        """Generate ``epoch_size`` distinct training and ``val_size`` disjoint validation prompts from
        ``seed`` (the validation ones from ``val_seed`` when given)."""
        if epoch_size < 1 or val_size < 0:
            raise ValueError(f"need epoch_size >= 1 and val_size >= 0, got {epoch_size}, {val_size}")
        val = _validation(task, seed, val_seed, val_size)
        taken = {holdout_key(p) for p in val}
        train = _generate(task, random.Random(f"rollstream-train:{seed}"), epoch_size, taken, "training")
        return cls(train, val, seed=seed, shuffle=shuffle, num_epochs=num_epochs)

    @classmethod
    def fresh_from_task(
        cls,
        task: Task,
        *,
        seed: int = 0,
        epoch_size: int = 1024,
        val_size: int = 0,
        num_epochs: int | None = None,
        val_seed: int | None = None,
    ) -> PromptSource:
        """Draw a fresh training prompt at every (epoch, index) position, seeded by (seed, epoch, index) so
        every shard and every restart sees the same one; validation prompts (``val_size``, as in
        ``from_task``) are never drawn for training. ``epoch_size`` only sets how positions count epochs."""
        if epoch_size < 1 or val_size < 0:
            raise ValueError(f"need epoch_size >= 1 and val_size >= 0, got {epoch_size}, {val_size}")
        val = _validation(task, seed, val_seed, val_size)
        taken = {holdout_key(p) for p in val}
        probe = _generate(task, random.Random(f"rollstream-fresh-probe:{seed}"), 1, taken, "training")
        src = cls(probe, val, seed=seed, shuffle=False, num_epochs=num_epochs)
        src._fresh, src._size = task, epoch_size
        return src

    @classmethod
    def from_jsonl(
        cls,
        path: str | Path,
        *,
        seed: int = 0,
        val_size: int = 0,
        val_file: str | Path | None = None,
        shuffle: bool = True,
        num_epochs: int | None = None,
        vocab_check: bool = True,
    ) -> PromptSource:
        """Load ``{"prompt", "answer", "uid"?, "meta"?}`` lines; validation is ``val_file`` or the last
        ``val_size`` lines."""
        if val_size < 0:
            raise ValueError(f"val_size must be >= 0, got {val_size}")
        rows = load_jsonl(path, vocab_check=vocab_check)
        if val_file is not None:
            val = load_jsonl(val_file, vocab_check=vocab_check)
            if val_size:
                val = val[:val_size]
        elif val_size:
            if val_size >= len(rows):
                raise ValueError(
                    f"{path}: val_size={val_size} leaves no training prompts ({len(rows)} lines)"
                )
            rows, val = rows[:-val_size], rows[-val_size:]
        else:
            val = []
        val_uids = {p.uid for p in val}
        val_texts = {p.text for p in val}
        train = [p for p in rows if p.uid not in val_uids and p.text not in val_texts]
        if not train:
            raise ValueError(f"{path}: no training prompts left after removing validation prompts")
        return cls(train, val, seed=seed, shuffle=shuffle, num_epochs=num_epochs)

    # ------------------------------------------------------------------ views
    @property
    def epoch_size(self) -> int:
        """Number of training prompts in one full epoch (all shards together)."""
        return self._size

    def __len__(self) -> int:
        """Number of prompts this shard draws per epoch."""
        return len(range(self.shard_index, self._size, self.shard_count))

    @property
    def fresh(self) -> bool:
        """True when every position draws a new prompt (``fresh_from_task``) rather than a fixed set."""
        return self._fresh is not None

    def prompt_at(self, epoch: int, pos: int) -> Prompt:
        """The training prompt at position ``pos`` of ``epoch`` (the same for every shard and restart)."""
        if self._fresh is None:
            return self._train[self.epoch_order(epoch)[pos]]
        rng = random.Random(f"rollstream-fresh:{self.seed}:{epoch}:{pos}")
        for _ in range(1000):
            p = self._fresh.make_prompt(rng)
            if holdout_key(p) not in self._val_texts:
                return p
        raise ValueError(f"task {self._fresh.name!r} keeps drawing validation prompts; lower val_size")

    def val_prompts(self) -> list[Prompt]:
        """Return the held-out validation prompts (never among the training prompts)."""
        return list(self._val)

    def shard(self, index: int, count: int) -> PromptSource:
        """Return a view drawing positions ``p`` with ``p % count == index`` of each epoch; cursor is
        copied."""
        if self.shard_count != 1:
            raise ValueError("shard() must be called on an unsharded source")
        if not 0 <= index < count:
            raise ValueError(f"need 0 <= index < count, got index={index}, count={count}")
        if count > self._size:
            raise ValueError(f"{count} shards but only {self._size} prompts per epoch")
        view = PromptSource.__new__(PromptSource)
        view.__dict__.update(self.__dict__)
        view._order = list(self._order)
        view.shard_index = index
        view.shard_count = count
        return view

    # ------------------------------------------------------------------ cursor and iteration
    @property
    def cursor(self) -> Cursor:
        """``(epoch, index)`` of the next prompt to draw; ``index`` is its position in the epoch order."""
        return self._normalize(self._epoch, self._pos)

    @cursor.setter
    def cursor(self, value: Cursor) -> None:
        """Resume from ``(epoch, index)`` as previously read from ``cursor``."""
        epoch, index = int(value[0]), int(value[1])
        if epoch < 0 or not 0 <= index <= self._size:
            raise ValueError(f"cursor out of range: {value!r} (epoch_size={self._size})")
        self._epoch, self._pos = epoch, index

    def _normalize(self, epoch: int, pos: int) -> Cursor:
        """Advance ``pos`` to this shard's next position, rolling over to the next epoch at the end."""
        pos += (self.shard_index - pos) % self.shard_count
        if pos >= self._size:
            return epoch + 1, self.shard_index
        return epoch, pos

    def epoch_order(self, epoch: int) -> list[int]:
        """Return the permutation of training-prompt indices used in ``epoch`` (same for every shard)."""
        if epoch != self._order_epoch:
            order = list(range(len(self._train)))
            if self.shuffle:
                random.Random(f"rollstream-epoch:{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def __iter__(self) -> Iterator[tuple[int, int, Prompt]]:
        """Return self: iteration continues from (and advances) ``cursor``."""
        return self

    def __next__(self) -> tuple[int, int, Prompt]:
        """Return the next ``(epoch, index_in_epoch, prompt)`` for this shard and advance the cursor."""
        epoch, pos = self.cursor
        if self.num_epochs is not None and epoch >= self.num_epochs:
            raise StopIteration
        prompt = self.prompt_at(epoch, pos)
        self._epoch, self._pos = self._normalize(epoch, pos + 1)
        return epoch, pos, prompt

    def take(self, n: int) -> list[tuple[int, int, Prompt]]:
        """Draw up to ``n`` items (fewer if ``num_epochs`` runs out)."""
        out: list[tuple[int, int, Prompt]] = []
        for item in self:
            out.append(item)
            if len(out) >= n:
                break
        return out


def _check_unique(prompts: Sequence[Prompt], what: str) -> None:
    """Raise ValueError if two prompts in ``prompts`` share a uid."""
    seen: set[str] = set()
    for p in prompts:
        if p.uid in seen:
            raise ValueError(f"duplicate uid {p.uid!r} in {what} prompts")
        seen.add(p.uid)


def _validation(task: Task, seed: int, val_seed: int | None, n: int) -> list[Prompt]:
    """The ``n`` held-out prompts the task draws from ``val_seed``, else the run's ``seed`` (distinct holdout
    keys)."""
    drawn_from = seed if val_seed is None else val_seed
    return _generate(task, random.Random(f"rollstream-val:{drawn_from}"), n, set(), "validation")


def _generate(task: Task, rng: random.Random, n: int, exclude: set[str], what: str) -> list[Prompt]:
    """Draw ``n`` prompts with distinct holdout keys (texts, unless the task sets one) not in ``exclude``;
    ValueError if the task cannot supply them."""
    out: list[Prompt] = []
    seen = set(exclude)
    max_draws = max(1000, 50 * n)
    draws = 0
    while len(out) < n:
        if draws >= max_draws:
            raise ValueError(
                f"task {task.name!r} gave only {len(out)} distinct {what} prompts of {n} after {draws} "
                "draws; "
                "lower epoch_size/val_size or widen the task"
            )
        draws += 1
        p = task.make_prompt(rng)
        if holdout_key(p) in seen:
            continue
        seen.add(holdout_key(p))
        out.append(p)
    return out


def _field_error(path: str | Path, lineno: int, field: str, msg: str) -> ValueError:
    """Build the ValueError for a bad JSONL line, naming file, line number and field."""
    return ValueError(f"{path}:{lineno}: field {field!r}: {msg}")


def _parse_line(
    path: str | Path, lineno: int, line: str, vocab_check: bool, first_line: dict[str, int]
) -> Prompt:
    """One JSONL line as a Prompt (its uid as given, or from its content; `first_line` maps the uids read so
    far to their line); ValueError names the field."""
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    text = obj.get("prompt")
    if not isinstance(text, str) or not text:
        raise _field_error(path, lineno, "prompt", "missing or not a non-empty string")
    answer = obj.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer:
        raise _field_error(path, lineno, "answer", "missing or not a non-empty string/integer")
    if vocab_check:
        for name, value in (("prompt", text), ("answer", answer)):
            try:
                check_vocab(value, "value")
            except ValueError as exc:
                raise _field_error(path, lineno, name, str(exc)) from None
    uid = obj.get("uid")
    if uid is None:
        uid = content_uid("jsonl", text, answer)
    elif not isinstance(uid, str | int) or isinstance(uid, bool) or uid == "":
        raise _field_error(path, lineno, "uid", "must be a non-empty string or integer")
    uid = str(uid)
    if uid in first_line:
        raise _field_error(path, lineno, "uid", f"duplicate uid {uid!r} (first on line {first_line[uid]})")
    first_line[uid] = lineno
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise _field_error(path, lineno, "meta", "must be a JSON object")
    return Prompt(uid=uid, text=text, answer=answer, meta={**meta, "line": lineno})


def load_jsonl(path: str | Path, *, vocab_check: bool = True) -> list[Prompt]:
    """Parse a prompt JSONL file (blank lines skipped); ValueError names the file, line and field at fault."""
    prompts: list[Prompt] = []
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            prompts.append(_parse_line(path, lineno, line, vocab_check, first_line))
    return prompts
