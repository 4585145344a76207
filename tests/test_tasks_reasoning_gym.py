"""reasoning-gym datasets as tasks: prompts, the dataset's verifier as the reward, a held-out split that no
training prompt reaches, and the config's errors naming the field and value."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("reasoning_gym")

from rollstream.config import ConfigError, load_config  # noqa: E402
from rollstream.tasks import (  # noqa: E402  # noqa: E402
    Prompt,
    PromptSource,
    ReasoningGymTask,
    build_prompt_source,
    build_task,
    holdout_key,
    make_task,
)
from rollstream.tasks.reasoning_gym import extract_answer  # noqa: E402

TWO_TERMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def task(**kwargs: object) -> ReasoningGymTask:
    """basic_arithmetic with 2 terms of 1-2 digits (the issue's reference task) unless told otherwise."""
    settings = kwargs.pop("settings", TWO_TERMS)
    return ReasoningGymTask("basic_arithmetic", settings, **kwargs)  # type: ignore[arg-type]


def test_prompts_are_the_datasets_items_drawn_by_the_rng() -> None:
    t = task(instruction="Answer with the number only.")
    a = [t.make_prompt(random.Random(7)) for _ in range(3)]
    assert a == [t.make_prompt(random.Random(7)) for _ in range(3)]  # reproducible from the rng alone
    rng = random.Random(1)
    for _ in range(50):
        p = t.make_prompt(rng)
        index = int(p.uid.removeprefix("rg:basic_arithmetic:"))
        item = t.entry(index)
        assert p.text == f"{item['question']}\nAnswer with the number only." and p.answer == item["answer"]
        assert holdout_key(p) == f"rg:basic_arithmetic:{item['metadata']['expression']}"
        assert t.reward(p, p.answer).exact and t.tool(p.text) is None
    assert make_task("rg:basic_arithmetic", settings=TWO_TERMS).name == "rg:basic_arithmetic"


def test_reward_is_the_datasets_verifier_on_the_extracted_answer() -> None:
    t = task()
    p = next(q for q in (t.make_prompt(random.Random(i)) for i in range(200)) if int(q.answer) > 9)
    lhs = p.text.removeprefix("Calculate ").rstrip(".")
    right = t.reward(p, f"{lhs} = {p.answer}")
    assert right.exact and right.score == 1.0 and right.metrics == {"acc": 1.0, "score": 1.0, "answered": 1.0,
                                                                    "wrong_sign": 0.0}
    wrong = t.reward(p, f"{lhs} = {int(p.answer) + 1}")
    assert not wrong.exact and wrong.score == 0.0
    nothing = t.reward(p, "I cannot say.")
    assert nothing.score == 0.0 and nothing.metrics["answered"] == 0.0
    bare = Prompt(uid=p.uid, text=p.text, answer=p.answer)  # meta lost on the way: the uid is enough
    assert t.reward(bare, p.answer).exact
    tagged = task(extract="answer_tag")
    assert tagged.reward(p, f"think 3 <answer>{p.answer}</answer> 5").exact
    assert not tagged.reward(p, p.answer).exact  # no tag, no answer
    rebuilt = Prompt(uid="rollout_00-3", text=p.text, answer=p.answer)  # the trainer's recent prompts
    assert t.reward(rebuilt, f"= {p.answer}").exact and not t.reward(rebuilt, "0").exact


def test_sign_and_magnitude_credit_score_the_parts_of_a_wrong_number_but_never_as_exact() -> None:
    rng = random.Random(3)
    items = [task().make_prompt(rng) for _ in range(400)]
    neg = next(p for p in items if int(p.answer) < -1)
    pos = next(p for p in items if int(p.answer) > 1)
    plain, shaped = task(), task(sign_credit=0.25, magnitude_credit=0.5)
    magnitude = str(-int(neg.answer))
    assert plain.reward(neg, f"= {magnitude}").score == 0.0  # the verifier alone: no credit
    half = shaped.reward(neg, f"= {magnitude}")  # the right magnitude, the wrong sign
    assert half.score == 0.5 and not half.exact and half.metrics["wrong_sign"] == 1.0
    assert half.metrics["acc"] == 0.0  # what validation counts is unchanged
    signed = shaped.reward(neg, f"= {int(neg.answer) - 1}")  # the right sign, the wrong magnitude
    assert signed.score == 0.25 and not signed.exact and signed.metrics["wrong_sign"] == 0.0
    assert shaped.reward(neg, f"= {neg.answer}").score == 1.0  # the right answer keeps full credit
    assert shaped.reward(neg, f"= {int(magnitude) + 1}").score == 0.0  # both parts wrong: nothing
    assert shaped.reward(neg, "no number").score == 0.0
    assert shaped.reward(pos, f"= {int(pos.answer) + 1}").score == 0.25
    # the verifier's substring credit ("-12" holds "12": 2/3) would pay the wrong sign more than a right one
    # earns; the numeric credit replaces it: the right magnitude alone
    assert plain.reward(pos, f"= -{pos.answer}").score == len(pos.answer) / (len(pos.answer) + 1)
    assert shaped.reward(pos, f"= -{pos.answer}").score == 0.5
    with pytest.raises(ValueError, match="data.sign_credit=1.0 must be in"):
        task(sign_credit=1.0)
    with pytest.raises(ValueError, match="data.sign_credit=0.5 \\+ data.magnitude_credit=0.5 must be < 1"):
        task(sign_credit=0.5, magnitude_credit=0.5)
    base = ["model.backend=hf", "model.hf_path=/nowhere", "data.task=rg:basic_arithmetic"]
    credit = ["data.sign_credit=0.25", "data.magnitude_credit=0.5"]
    built = build_task(load_config("pipeline.yaml", [*base, *credit]))
    assert (built.sign_credit, built.magnitude_credit) == (0.25, 0.5)
    with pytest.raises(ConfigError, match="data.magnitude_credit=0.5 is for rg:<dataset> tasks"):
        load_config("pipeline.yaml", ["data.task=arith", "data.magnitude_credit=0.5"])
    with pytest.raises(ConfigError, match="must be < 1"):
        load_config("pipeline.yaml", [*base, "data.sign_credit=0.6", "data.magnitude_credit=0.4"])
    with pytest.raises(ConfigError, match="sign_credit"):
        load_config("pipeline.yaml", [*base, "data.sign_credit=-0.1"])


@pytest.mark.parametrize(("how", "text", "answer"), [
    ("last_number", "6 + 5 = 11", "11"), ("last_number", "1 - 8 = -7.", "-7"),
    ("last_number", "none", None), ("answer_tag", "<answer> 4 </answer>", "4"),
    ("last_line", "work\n\n 42 \n", "42"), ("whole", "  x ", "x"), ("whole", "  ", None),
])
def test_extract_answer(how: str, text: str, answer: str | None) -> None:
    assert extract_answer(text, how) == answer


@pytest.mark.parametrize("fresh", [True, False])
def test_no_training_prompt_reaches_the_held_out_split(fresh: bool) -> None:
    # one-digit sums: about 100 problems, so training draws keep meeting validation problems, and skip them
    t = task(settings={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                       "allow_negation": False})
    make = PromptSource.fresh_from_task if fresh else PromptSource.from_task
    src = make(t, seed=3, epoch_size=40, val_size=30)
    held_out = {holdout_key(p) for p in src.val_prompts()}
    assert len(held_out) == 30
    drawn = [p for _epoch, _pos, p in src.take(400)] if fresh else [p for _e, _i, p in src.take(40)]
    assert drawn and not {holdout_key(p) for p in drawn} & held_out
    assert not {p.text for p in drawn} & {p.text for p in src.val_prompts()}
    if fresh:
        assert len({p.text for p in drawn}) > 40  # drew widely; the split held anyway
    # the same problem worded differently is still the same problem
    val = src.val_prompts()[0]
    twin = Prompt(uid="rg:basic_arithmetic:1", text="What is " + val.text, answer=val.answer,
                  meta=dict(val.meta))
    with pytest.raises(ValueError, match="also appears in the validation set"):
        PromptSource([twin], [val])


def test_config_builds_the_task_and_names_bad_fields() -> None:
    base = ["model.backend=hf", "model.hf_path=/nowhere", "data.task=rg:basic_arithmetic",
            "data.instruction=Answer with the number only.", "data.val_size=8"]
    args = [f"data.task_args.{k}={v}" for k, v in TWO_TERMS.items()]
    cfg = load_config("pipeline.yaml", base + args)
    t = build_task(cfg)
    assert isinstance(t, ReasoningGymTask) and t.instruction == "Answer with the number only."
    val = build_prompt_source(cfg, t).val_prompts()
    assert len(val) == 8 and all(p.text.endswith("\nAnswer with the number only.") for p in val)
    cases = {
        "data.task=rg:basic_arithmetc": "data.task=rg:basic_arithmetc: reasoning-gym has no dataset "
                                        "'basic_arithmetc'; did you mean basic_arithmetic",
        "data.task_args.min_term=2": "data.task_args.min_term=2: not a setting of reasoning-gym dataset "
                                     "'basic_arithmetic' (settings: min_terms,",
        "data.task_args.seed=4": "data.task_args.seed: set by rollstream",
        "data.task_args.min_terms=0": "'basic_arithmetic' refuses it: min_terms must be positive",
        "data.answer_extract=first": "data.answer_extract='first'",
        "model.backend=tiny": "data.task=rg:basic_arithmetic needs model.backend=hf",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config("pipeline.yaml", [*base, override])
        assert message in str(err.value), (override, str(err.value))
    with pytest.raises(ConfigError, match="data.task='sort' must be reverse, arith or rg:<reasoning-gym"):
        load_config("pipeline.yaml", ["data.task=sort"])
    with pytest.raises(ConfigError, match=r"data.task_args=\{'x': 1\} is for rg:<dataset> tasks"):
        load_config("pipeline.yaml", ["data.task=arith", "data.task_args.x=1"])
