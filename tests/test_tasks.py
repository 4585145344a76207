"""Tests for rollstream.tasks: rewards, calculator, tool calls, prompt sources."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rollstream.tasks import (
    VOCAB_CHARS,
    ArithToolTask,
    Prompt,
    PromptSource,
    ReverseTask,
    RewardResult,
    Task,
    build_prompt_source,
    calculate,
    final_answer,
    find_tool_call,
    in_vocab,
    make_task,
)
from rollstream.tasks import arith as arith_mod


def _p(text: str, answer: str) -> Prompt:
    return Prompt(uid="t", text=text, answer=answer)


# ---------------------------------------------------------------- reverse
@pytest.mark.parametrize(
    ("response", "score", "exact"),
    [
        ("4321", 1.0, True),
        ("4331", 0.75, False),  # 3 of 4 positions
        ("43", 0.5, False),  # too short: 2 matches / 4
        ("432100", 4 / 6, False),  # too long: 4 matches / 6
        ("", 0.0, False),
        ("1234", 0.0, False),
        ("x4321", 0.0, False),  # shifted: no positional matches
    ],
)
def test_reverse_reward(response: str, score: float, exact: bool) -> None:
    r = ReverseTask().reward(_p("1234>", "4321"), response)
    assert isinstance(r, RewardResult)
    assert r.score == pytest.approx(score)
    assert r.exact is exact
    assert r.metrics == {"acc": float(exact), "score": pytest.approx(score)}


def test_reverse_prompt_shape() -> None:
    task = ReverseTask(min_digits=3, max_digits=6)
    rng = random.Random(0)
    for _ in range(200):
        p = task.make_prompt(rng)
        digits = p.text[:-1]
        assert p.text.endswith(">") and digits.isdigit() and 3 <= len(digits) <= 6
        assert p.answer == digits[::-1]
        assert task.reward(p, p.answer).exact
        assert task.tool(p.text + p.answer) is None
    with pytest.raises(ValueError):
        ReverseTask(min_digits=5, max_digits=3)


# ---------------------------------------------------------------- calculator
@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("12*34+5", 413),
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("10-3-2", 5),  # left associative
        ("2*3*4", 24),
        ("-5+2", -3),
        ("-(2+3)*-2", 10),
        (" 7 * ( 8 - 10 ) ", -14),
        ("007", 7),
        ("((((1))))", 1),
        ("1000000*1000000", 10**12),
    ],
)
def test_calculate(expr: str, value: int) -> None:
    assert calculate(expr) == value


@pytest.mark.parametrize(
    "expr",
    [
        "",
        "   ",
        "1+",
        "*2",
        "(1+2",
        "1+2)",
        "()",
        "2/3",
        "2**3",  # factor after '*' must be a number or '(' — '**' is not power
        "1 2",
        "12 3*4",
        "abc",
        "__import__('os')",
        "1e5",
        "٣+1",  # non-ASCII digit
        "1000000*1000001",  # |result| > 10**12
        "9999999999999",  # literal too large
        "1+" * 32 + "1",  # longer than 64 chars
    ],
)
def test_calculate_rejects(expr: str) -> None:
    with pytest.raises(ValueError):
        calculate(expr)


def test_calculate_does_not_use_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("eval used")

    monkeypatch.setattr(builtins, "eval", boom)
    assert calculate("(3+4)*5") == 35
    assert "eval(" not in Path(arith_mod.__file__).read_text()


def test_calculate_length_limit_is_64() -> None:
    expr = "1+" * 31 + "10"  # exactly 64 chars
    assert len(expr) == 64
    assert calculate(expr) == 41
    with pytest.raises(ValueError, match="longer than 64"):
        calculate(expr + "0")


def _random_expr(rng: random.Random, depth: int) -> tuple[str, int, int]:
    """Random expression, its value by tree evaluation (reference, no eval), and max |intermediate|."""
    if depth == 0 or rng.random() < 0.3:
        v = rng.randint(0, 99999)
        return str(v), v, v
    ls, lv, lm = _random_expr(rng, depth - 1)
    rs, rv, rm = _random_expr(rng, depth - 1)
    op = rng.choice("+-*")
    value = lv + rv if op == "+" else lv - rv if op == "-" else lv * rv
    return f"({ls}{op}{rs})", value, max(lm, rm, abs(value))


def test_calculate_fuzz_against_tree() -> None:
    rng = random.Random(123)
    checked = rejected = 0
    for _ in range(3000):
        text, value, biggest = _random_expr(rng, 4)
        if len(text) > 64:
            continue
        if biggest > 10**12:
            with pytest.raises(ValueError, match="out of range"):
                calculate(text)
            rejected += 1
        else:
            assert calculate(text) == value, text
            checked += 1
    assert checked > 500 and rejected > 10


# ---------------------------------------------------------------- tool calls
@pytest.mark.parametrize(
    ("text", "expr"),
    [
        ("[calc:12*34+5]", "12*34+5"),
        ("let me see [calc:1+2]", "1+2"),
        ("[calc:1+2][=3] then [calc:3*3]", "3*3"),
        ("[calc:]", ""),
        ("[calc:1+2", None),  # incomplete
        ("[calc:1+2] ", None),  # does not end with the call
        ("[calc:1+2][=3]", None),  # ends with a tool result
        ("[calx:1+2]", None),
        ("1+2]", None),
        ("", None),
        ("[calc:1[2]", None),
    ],
)
def test_find_tool_call(text: str, expr: str | None) -> None:
    assert find_tool_call(text) == expr


def test_arith_tool() -> None:
    task = ArithToolTask()
    assert task.tool("[calc:12*34+5]") == "[=413]"
    assert task.tool("so [calc:3-45]") == "[=-42]"
    assert task.tool("[calc:1+]") == "[=err]"
    assert task.tool("[calc:]") == "[=err]"
    assert task.tool("[calc:99999999*99999999]") == "[=err]"
    assert task.tool("[calc:1+2") is None
    assert task.tool("[calc:1+2][=3]") is None
    assert task.tool("413") is None


@pytest.mark.parametrize(
    ("response", "score", "exact"),
    [
        ("413", 1.0, True),
        ("[calc:12*34+5][=413]413", 1.0, True),
        ("[calc:12*34+5][=413] so 413", 1.0, True),
        ("[calc:12*34+5][=413]", 0.1, False),  # no final answer after the tool result
        ("[calc:12*34+5][=413]412", 0.1, False),
        ("[calc:12*34][=408][calc:408+5][=413]413", 1.0, True),
        ("[calc:1+][=err]413", 1.0, True),
        ("[calc:1+][=err]5", 0.0, False),  # malformed call earns nothing
        ("412", 0.0, False),
        ("", 0.0, False),
        ("413 [calc:413", 1.0, True),  # dangling call text is ignored; the final integer is 413
        ("[calc:1+2][=3]413 [calc:9", 1.0, True),
        ("[calc:413]", 0.1, False),  # call alone is not an answer
    ],
)
def test_arith_reward(response: str, score: float, exact: bool) -> None:
    r = ArithToolTask().reward(_p("12*34+5=?", "413"), response)
    assert r.score == pytest.approx(score)
    assert r.exact is exact
    assert r.metrics["acc"] == float(exact)
    assert r.metrics["score"] == pytest.approx(score)


def test_arith_reward_negative_and_metrics() -> None:
    task = ArithToolTask()
    p = _p("3-45=?", "-42")
    assert task.reward(p, "-42").exact
    assert not task.reward(p, "42").exact
    assert not task.reward(p, "3-45").exact  # last integer is 45 (binary minus), not -45
    r = task.reward(p, "[calc:3-45][=-42][calc:x]-42")
    assert r.exact and r.metrics["tool_calls"] == 2.0 and r.metrics["tool_errors"] == 1.0
    assert final_answer("[calc:1+2][=3]") is None
    assert final_answer("a 1 b -7") == "-7"
    assert not task.reward(p, "9" * 5000).exact  # absurdly long integer refused, no crash


def test_arith_prompts() -> None:
    task = ArithToolTask(max_operand=99, n_ops=(1, 2))
    rng = random.Random(1)
    seen_ops = set()
    for _ in range(300):
        p = task.make_prompt(rng)
        assert p.text.endswith("=?")
        expr = p.text[:-2]
        assert calculate(expr) == int(p.answer)
        n_ops = sum(expr.count(c) for c in "+-*")
        assert 1 <= n_ops <= 2 and p.meta["n_ops"] == n_ops
        seen_ops.add(n_ops)
        # the verbatim tool call round-trip earns full reward
        call = f"[calc:{expr}]"
        result = task.tool(call)
        assert result == f"[={p.answer}]"
        assert task.reward(p, call + result + p.answer).exact
    assert seen_ops == {1, 2}
    assert ArithToolTask(n_ops=3).make_prompt(rng).meta["n_ops"] == 3
    with pytest.raises(ValueError):
        ArithToolTask(n_ops=(2, 1))
    with pytest.raises(ValueError):
        ArithToolTask(ops="/")
    with pytest.raises(ValueError, match="calculator limits"):
        ArithToolTask(max_operand=999, n_ops=(1, 4))  # 999**5 > 10**12


# ---------------------------------------------------------------- make_task / vocab
def test_make_task() -> None:
    assert isinstance(make_task("reverse", min_digits=2, max_digits=2), ReverseTask)
    arith = make_task("arith", max_operand=9)
    assert isinstance(arith, ArithToolTask) and isinstance(arith, Task)
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*arith, reverse"):
        make_task("nope")


def test_vocabulary() -> None:
    assert len(set(VOCAB_CHARS)) == len(VOCAB_CHARS)
    for task in (ReverseTask(), ArithToolTask(), ArithToolTask(max_operand=999, n_ops=(1, 3))):
        rng = random.Random(7)
        for _ in range(500):
            p = task.make_prompt(rng)
            assert in_vocab(p.text) and in_vocab(p.answer), p
            assert in_vocab(task.tool(f"[calc:{p.text[:-2]}]") or "")
    assert in_vocab("[=err]") and in_vocab("[calc:1+2]")
    assert not in_vocab("Hello")


# ---------------------------------------------------------------- prompt source
def _drain_epoch(src: PromptSource, epoch: int) -> list[tuple[int, int, Prompt]]:
    src.cursor = (epoch, 0)
    out = []
    while src.cursor[0] == epoch:
        out.append(next(src))
    return out


def train_prompts(src: PromptSource) -> list[Prompt]:
    """The training prompts of epoch 0 in their unshuffled order."""
    return [src.prompt_at(0, i) for i in range(src.epoch_size)] if src.fresh else list(src._train)


def test_generator_source_deterministic() -> None:
    a = PromptSource.from_task(ReverseTask(), seed=3, epoch_size=50, val_size=10)
    b = PromptSource.from_task(ReverseTask(), seed=3, epoch_size=50, val_size=10)
    c = PromptSource.from_task(ReverseTask(), seed=4, epoch_size=50, val_size=10)
    ta, tb, tc = a.take(120), b.take(120), c.take(120)
    assert [(e, i, p.uid) for e, i, p in ta] == [(e, i, p.uid) for e, i, p in tb]
    assert [p.uid for _, _, p in ta] != [p.uid for _, _, p in tc]
    assert [p.uid for p in a.val_prompts()] == [p.uid for p in b.val_prompts()]
    assert len({p.uid for p in train_prompts(a)}) == 50


def test_epochs_same_prompts_reshuffled() -> None:
    src = PromptSource.from_task(ArithToolTask(), seed=0, epoch_size=40)
    items = src.take(120)
    assert [e for e, _, _ in items] == [0] * 40 + [1] * 40 + [2] * 40
    assert [i for _, i, _ in items] == list(range(40)) * 3
    epochs = [[p.uid for _, _, p in items[k * 40 : (k + 1) * 40]] for k in range(3)]
    assert set(epochs[0]) == set(epochs[1]) == set(epochs[2])
    assert len(set(epochs[0])) == 40
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    unshuffled = PromptSource.from_task(ArithToolTask(), seed=0, epoch_size=40, shuffle=False)
    assert [p.uid for _, _, p in unshuffled.take(40)] == [p.uid for p in train_prompts(unshuffled)]


def test_val_split_disjoint_generator() -> None:
    # small prompt space (90 two-digit... 100 texts) makes collisions likely without the exclusion
    task = ReverseTask(min_digits=2, max_digits=2)
    src = PromptSource.from_task(task, seed=1, epoch_size=60, val_size=30)
    val = src.val_prompts()
    assert len(val) == 30
    train = train_prompts(src)
    assert {p.uid for p in val}.isdisjoint(p.uid for p in train)
    assert {p.text for p in val}.isdisjoint(p.text for p in train)
    drawn = {p.uid for _, _, p in src.take(180)}
    assert drawn.isdisjoint(p.uid for p in val)
    with pytest.raises(ValueError, match="distinct"):
        PromptSource.from_task(task, seed=1, epoch_size=90, val_size=30)  # only 100 distinct texts


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_disjoint_and_covering(count: int) -> None:
    src = PromptSource.from_task(ReverseTask(), seed=5, epoch_size=50)
    shards = [src.shard(k, count) for k in range(count)]
    assert sum(len(s) for s in shards) == 50
    for epoch in range(3):
        per_shard = [_drain_epoch(s, epoch) for s in shards]
        positions = [i for items in per_shard for _, i, _ in items]
        uids = [p.uid for items in per_shard for _, _, p in items]
        assert sorted(positions) == list(range(50))
        assert sorted(uids) == sorted(p.uid for p in train_prompts(src))
        for a in range(count):
            for b in range(a + 1, count):
                assert {p.uid for _, _, p in per_shard[a]}.isdisjoint(p.uid for _, _, p in per_shard[b])
        # a shard's items follow the global epoch order
        order = src.epoch_order(epoch)
        train = train_prompts(src)
        for items in per_shard:
            assert all(p.uid == train[order[i]].uid for _, i, p in items)
    with pytest.raises(ValueError):
        src.shard(count, count)
    with pytest.raises(ValueError):
        src.shard(0, 2).shard(0, 2)


def test_cursor_resume() -> None:
    src = PromptSource.from_task(ArithToolTask(), seed=9, epoch_size=30)
    full = src.take(100)
    fresh = PromptSource.from_task(ArithToolTask(), seed=9, epoch_size=30)
    first = fresh.take(47)
    saved = fresh.cursor
    assert saved == (1, 17)
    resumed = PromptSource.from_task(ArithToolTask(), seed=9, epoch_size=30)
    resumed.cursor = saved
    rest = resumed.take(53)
    assert [(e, i, p.uid) for e, i, p in first + rest] == [(e, i, p.uid) for e, i, p in full]
    # end of epoch rolls over
    resumed.cursor = (2, 30)
    assert resumed.cursor == (3, 0)
    with pytest.raises(ValueError):
        resumed.cursor = (0, 31)
    # sharded cursor skips positions of other shards and resumes consistently
    shard = PromptSource.from_task(ArithToolTask(), seed=9, epoch_size=30).shard(1, 3)
    assert shard.cursor == (0, 1)
    got = shard.take(12)
    assert [i for _, i, _ in got] == list(range(1, 30, 3)) + [1, 4]
    assert shard.cursor == (1, 7)
    shard.cursor = (0, 29)
    assert shard.cursor == (1, 1)


def test_num_epochs_stops() -> None:
    src = PromptSource.from_task(ReverseTask(), seed=0, epoch_size=10, num_epochs=2)
    assert len(list(src)) == 20
    assert list(src) == []


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(n: int) -> list[str]:
    return [json.dumps({"prompt": f"{i:03d}>", "answer": f"{i:03d}"[::-1]}) for i in range(n)]


def test_jsonl_source(tmp_path: Path) -> None:
    f = _write(tmp_path / "p.jsonl", _rows(20) + ["", json.dumps({"prompt": "9>", "answer": 9, "uid": "u9"})])
    src = PromptSource.from_jsonl(f, seed=2, val_size=5)
    assert src.epoch_size == 16
    val = src.val_prompts()
    assert [p.text for p in val] == ["016>", "017>", "018>", "019>", "9>"]
    assert val[-1].uid == "u9" and val[-1].answer == "9" and val[-1].meta["line"] == 22
    assert {p.uid for p in val}.isdisjoint(p.uid for _, _, p in src.take(48))
    # uids derived from content are stable across loads
    again = PromptSource.from_jsonl(f, seed=2, val_size=5)
    assert [p.uid for p in train_prompts(again)] == [p.uid for p in train_prompts(src)]
    # separate val file; overlapping training lines are removed
    vf = _write(tmp_path / "v.jsonl", [_rows(20)[3], json.dumps({"prompt": "77>", "answer": "77"})])
    src2 = PromptSource.from_jsonl(f, val_file=vf)
    assert src2.epoch_size == 20
    assert "003>" not in {p.text for p in train_prompts(src2)}
    assert [p.text for p in src2.val_prompts()] == ["003>", "77>"]
    # epochs reshuffle the same prompts
    items = src2.take(40)
    assert {p.uid for _, _, p in items[:20]} == {p.uid for _, _, p in items[20:]}
    assert [p.uid for _, _, p in items[:20]] != [p.uid for _, _, p in items[20:]]


@pytest.mark.parametrize(
    ("line", "pattern"),
    [
        ("{not json", r"p\.jsonl:3: invalid JSON"),
        ("[1, 2]", r"p\.jsonl:3: expected a JSON object"),
        ('{"answer": "1"}', r"p\.jsonl:3: field 'prompt'"),
        ('{"prompt": "12>"}', r"p\.jsonl:3: field 'answer'"),
        ('{"prompt": "12>", "answer": null}', r"p\.jsonl:3: field 'answer'"),
        ('{"prompt": "Hello>", "answer": "1"}', r"p\.jsonl:3: field 'prompt'.*'H'"),
        ('{"prompt": "12>", "answer": "1", "uid": ""}', r"p\.jsonl:3: field 'uid'"),
        ('{"prompt": "12>", "answer": "1", "meta": 3}', r"p\.jsonl:3: field 'meta'"),
        ('{"prompt": "000>", "answer": "000"}', r"p\.jsonl:3: field 'uid'.*first on line 1"),
    ],
)
def test_jsonl_bad_line(tmp_path: Path, line: str, pattern: str) -> None:
    f = _write(tmp_path / "p.jsonl", _rows(2) + [line])
    with pytest.raises(ValueError, match=pattern):
        PromptSource.from_jsonl(f)


def test_jsonl_val_too_large(tmp_path: Path) -> None:
    f = _write(tmp_path / "p.jsonl", _rows(3))
    with pytest.raises(ValueError, match="no training prompts"):
        PromptSource.from_jsonl(f, val_size=3)


def test_reverse_fixed_width_prompts_are_right_aligned_with_spaces() -> None:
    task = ReverseTask(min_digits=3, max_digits=6, fixed_width=True)
    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        p = task.make_prompt(rng)
        assert len(p.text) == 7 and p.text.endswith(">")
        digits = p.text[:-1].lstrip(" ")
        assert digits.isdigit() and p.answer == digits[::-1]
        seen.add(len(digits))
    assert seen == {3, 4, 5, 6}
    assert task.reward(_p("   123>", "321"), "321").exact


def test_fresh_source_draws_new_prompts_deterministically_and_never_validation() -> None:
    # only 1000 prompts exist: repeats and val collisions happen
    task = ReverseTask(min_digits=3, max_digits=3)
    src = PromptSource.fresh_from_task(task, seed=5, epoch_size=64, val_size=100)
    val = {p.text for p in src.val_prompts()}
    assert len(val) == 100 and src.fresh
    drawn = [p for _, _, p in src.take(640)]  # 10 epochs of 64 positions
    assert not val & {p.text for p in drawn}
    assert len({p.text for p in drawn}) > 400  # new prompts every epoch, not the same 64 again
    again = PromptSource.fresh_from_task(task, seed=5, epoch_size=64, val_size=100)
    assert [p.text for _, _, p in again.take(640)] == [p.text for p in drawn]
    other = PromptSource.fresh_from_task(task, seed=6, epoch_size=64, val_size=100)
    assert [p.text for _, _, p in other.take(20)] != [p.text for p in drawn[:20]]


def test_fresh_source_shards_and_cursor_see_the_same_prompt_per_position() -> None:
    src = PromptSource.fresh_from_task(ReverseTask(), seed=1, epoch_size=10, val_size=4)
    whole = {(e, i): p.text for e, i, p in src.take(30)}
    fresh = PromptSource.fresh_from_task(ReverseTask(), seed=1, epoch_size=10, val_size=4)
    a, b = fresh.shard(0, 2), fresh.shard(1, 2)
    parts = {(e, i): p.text for s in (a, b) for e, i, p in s.take(15)}
    assert parts == whole
    resumed = PromptSource.fresh_from_task(ReverseTask(), seed=1, epoch_size=10, val_size=4).shard(1, 2)
    resumed.cursor = (1, 3)
    e, i, p = next(resumed)
    assert (e, i) == (1, 3) and p.text == whole[(1, 3)]


def test_config_builds_a_fresh_source_by_default() -> None:
    from rollstream.config import load_config
    from rollstream.tasks import build_prompt_source

    cfg = load_config(None, ["data.val_size=8"])
    assert cfg.data.fresh_prompts and build_prompt_source(cfg).fresh
    fixed = build_prompt_source(
        load_config(None, ["data.val_size=8", "data.fresh_prompts=false", "data.epoch_size=20"])
    )
    assert not fixed.fresh and len(train_prompts(fixed)) == 20
    assert load_config(None, []).data.val_size >= 256


@pytest.mark.parametrize("fresh", [True, False])
def test_a_pinned_val_seed_scores_every_training_seed_on_one_held_out_set(fresh: bool) -> None:
    """data.val_seed: runs of different run.seed hold out the same prompts and train on different draws, none
    of them held out; unpinned, the held-out set is run.seed's own (as before)."""
    from rollstream.config import load_config

    base = ["data.task=arith", "data.val_size=50", "data.epoch_size=64", f"data.fresh_prompts={fresh}"]
    pinned = [load_config(None, [*base, f"run.seed={s}", "data.val_seed=9"]) for s in (0, 1)]
    sources = [build_prompt_source(cfg) for cfg in pinned]
    held = [[p.text for p in s.val_prompts()] for s in sources]
    assert held[0] == held[1] and len(set(held[0])) == 50
    drawn = [[p.text for _, _, p in s.take(200)] for s in sources]
    assert drawn[0] != drawn[1]
    assert not set(held[0]) & (set(drawn[0]) | set(drawn[1]))
    own = [[p.text for p in build_prompt_source(load_config(None, [*base, f"run.seed={s}"])).val_prompts()]
           for s in (0, 1)]
    assert own[0] != own[1]
    pinned_to_own = build_prompt_source(load_config(None, [*base, "run.seed=1", "data.val_seed=1"]))
    assert [p.text for p in pinned_to_own.val_prompts()] == own[1]


def test_val_seed_with_a_prompts_file_is_refused(tmp_path: Path) -> None:
    """A prompts file holds its own held-out split: naming a val_seed beside it is an error naming both."""
    from rollstream.config import ConfigError, load_config

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "12>", "answer": "21"}) + "\n")
    with pytest.raises(ConfigError, match=r"data.val_seed=3 is for generated prompts: data.prompts_file="):
        load_config(None, [f"data.prompts_file={path}", "data.val_seed=3"])
