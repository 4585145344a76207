"""The calculator as a tool turn of a reasoning-gym task (`data.tool: calculator`): the answer is read after
the last tool result, the tool metrics and their per-step ratios, validation through the tool loop, the
config's errors, `inspect`'s turns, a swap between turns stamped per turn and the tool's tokens kept out
of the loss, and the supervised warm start on generated traces (a tiny HF model built here: no downloads)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("reasoning_gym")
pytest.importorskip("transformers")

from consumers.trainer.evaluate import evaluate  # noqa: E402
from rollstream.config import ConfigError, load_config  # noqa: E402
from rollstream.model import Completion  # noqa: E402
from rollstream.model.chat import encode_prompt, encode_tool_result  # noqa: E402
from rollstream.model.hf import HFTokenizer  # noqa: E402
from rollstream.ops.inspect import decode_texts  # noqa: E402
from rollstream.tasks import CalculatorTask, ReasoningGymTask, build_task, holdout_key  # noqa: E402
from rollstream.tasks.calculator import tool_ratios, trace_texts  # noqa: E402
from rollstream.tasks.episode import greedy_episodes  # noqa: E402
from rollstream.testing.hf_tiny import build_tokenizer, make_tiny_hf_model  # noqa: E402

SETTINGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-", "*"],
            "allow_parentheses": False, "allow_negation": False}
TOOL = ["data.task=rg:basic_arithmetic", "data.tool=calculator", "rollout.multi_turn.enable=true",
        "rollout.multi_turn.max_turns=3", "model.backend=hf"]


def calc_task(reward: float = 0.1) -> CalculatorTask:
    return CalculatorTask(ReasoningGymTask("basic_arithmetic", SETTINGS), reward)


def a_prompt(task: CalculatorTask, negative: bool = False) -> Any:
    rng = random.Random(3)
    return next(p for p in iter(lambda: task.make_prompt(rng), None) if (int(p.answer) < 0) == negative)


def test_the_answer_is_what_the_model_wrote_after_the_last_tool_result() -> None:
    task = calc_task()
    p = a_prompt(task, negative=True)
    call, result, answer = trace_texts(task, p)
    expr = p.text.removeprefix("Calculate ").split(".")[0]
    assert call == f"[calc: {expr}]" and result == f"[={p.answer}]" and answer == p.answer
    right = task.reward(p, f"{call}\ntool\n{result}\nassistant\n{answer}")
    assert right.exact and right.score == 1.0
    assert right.metrics["called"] == 1.0 and right.metrics["right_called"] == 1.0
    assert right.metrics["wrong_expr"] == 0.0 and right.metrics["tool_errors"] == 0.0
    # the tool's number alone answers nothing: the model has to write it
    silent = task.reward(p, f"{call}\ntool\n{result}\nassistant\n")
    assert not silent.exact and silent.score == pytest.approx(0.1) and silent.metrics["answered"] == 0.0
    # a call with another expression, then a wrong answer: the format reward only
    wrong = task.reward(p, "[calc: 1 + 1]\ntool\n[=2]\nassistant\n2")
    assert not wrong.exact and wrong.score == pytest.approx(0.1) and wrong.metrics["wrong_expr"] == 1.0
    broken = task.reward(p, "[calc: two]\ntool\n[=err]\nassistant\n7")
    assert broken.score == 0.0 and broken.metrics["tool_errors"] == 1.0
    direct = task.reward(p, f"{expr} = {p.answer}")
    assert direct.exact and direct.metrics["called"] == 0.0 and direct.metrics["right_uncalled"] == 1.0
    assert calc_task(0.0).reward(p, "[calc: 1 + 1]\ntool\n[=2]\nassistant\n2").score == 0.0


def test_prompts_and_held_out_problems_are_the_wrapped_datasets() -> None:
    inner = ReasoningGymTask("basic_arithmetic", SETTINGS)
    task = CalculatorTask(inner)
    a, b = task.make_prompt(random.Random(5)), inner.make_prompt(random.Random(5))
    assert a == b and holdout_key(a) == holdout_key(b) and task.name == inner.name
    assert task.tool("x [calc: 3 * 4]") == "[=12]" and task.tool("[calc: 3 *") is None
    with pytest.raises(ValueError, match="data.tool_call_reward"):
        calc_task(1.0)


def test_ratios_of_the_per_answer_means() -> None:
    means = {"p/called": 0.5, "p/right_called": 0.4, "p/uncalled": 0.5, "p/right_uncalled": 0.1,
             "p/tool_calls": 0.8, "p/tool_errors": 0.2, "p/wrong_expr": 0.0}
    got = tool_ratios(means, "p/")
    assert got == pytest.approx({"p/acc_with_call": 0.8, "p/acc_without_call": 0.2, "p/calls_errored": 0.25,
                                 "p/calls_wrong_expr": 0.0})
    assert tool_ratios({"p/called": 0.0, "p/right_called": 0.0}, "p/") == {}


def test_the_config_names_the_field_at_fault() -> None:
    cfg = load_config(None, [*TOOL, "model.hf_path=unused"])
    assert isinstance(build_task(cfg), CalculatorTask)
    with pytest.raises(ConfigError, match="rollout.multi_turn.enable"):
        load_config(None, [*(t for t in TOOL if "multi_turn.enable" not in t), "model.hf_path=unused"])
    with pytest.raises(ConfigError, match="data.tool='calculator' is for rg"):
        load_config(None, ["data.task=arith", "data.tool=calculator", "rollout.multi_turn.enable=true"])


class ScriptedCalculator:
    """Turn 1 writes the prompt's call then junk (cut by the loop); turn 2 copies the tool's value, wrong on
    the prompts whose text holds `wrong_on`."""

    def __init__(self, tokenizer: HFTokenizer, wrong_on: str = "\x00", call: bool = True) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = None
        self.wrong_on = wrong_on
        self.call = call
        self.turns: list[int] = []

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, **_: Any) -> list[Completion]:
        tok, out = self.tokenizer, []
        self.turns.append(len(prompts))
        for p in prompts:
            text = tok.decode(p, skip_special=False)
            if "<|tool|>" in text:
                value = text.rsplit("[=", 1)[1].split("]")[0]
                ids = tok.encode(value + ("1" if self.wrong_on in text else "")) + [tok.eos_id]
            elif self.call:
                expr = text.split("Calculate ")[1].split(".")[0]
                ids = tok.encode(f"[calc: {expr}] = ?")
            else:
                ids = tok.encode("7") + [tok.eos_id]
            out.append(Completion(list(p), ids, [0.0] * len(ids), ids[-1] == tok.eos_id))
        return out


def test_validation_runs_the_tool_loop_as_the_producers_do() -> None:
    tok = HFTokenizer(build_tokenizer("bpe", chat_template=True))
    task = calc_task()
    prompts = [task.make_prompt(random.Random(i)) for i in range(8)]
    wrong_on = prompts[0].text.split(".")[0]
    policy = ScriptedCalculator(tok, wrong_on=wrong_on)
    episodes = greedy_episodes(policy, task, [encode_prompt(tok, p.text) for p in prompts], 16, 3)  # type: ignore[arg-type]
    assert policy.turns == [8, 8]  # every episode called once, then answered
    for p, ep in zip(prompts, episodes, strict=True):
        call, result, _ = trace_texts(task, p)
        tool = encode_tool_result(tok, result)
        n_call = len(tok.encode(call))
        assert ep.turns == 2 and ep.response_ids[n_call : n_call + len(tool)] == tool
        assert ep.generated[n_call : n_call + len(tool)] == [0] * len(tool)  # the tool's turn: not trained
    metrics = evaluate(ScriptedCalculator(tok, wrong_on=wrong_on), task, prompts, 16, 4, max_turns=3)  # type: ignore[arg-type]
    assert metrics["val/acc"] == pytest.approx(7 / 8) and metrics["val/called"] == 1.0
    assert metrics["val/acc_with_call"] == pytest.approx(7 / 8) and "val/acc_without_call" not in metrics
    assert metrics["val/calls_wrong_expr"] == 0.0
    # one turn (no tool loop): the call is never answered, nothing is right
    single = evaluate(ScriptedCalculator(tok), task, prompts, 16, 4, max_turns=1)  # type: ignore[arg-type]
    assert single["val/acc"] == 0.0 and "val/called" not in single


def test_inspect_shows_a_multi_turn_response_as_its_turns() -> None:
    from producers.rollout import Trajectory, build_rollout_sample

    tok = HFTokenizer(build_tokenizer("bpe", chat_template=True))
    task = calc_task()
    p = a_prompt(task)
    call, result, answer = trace_texts(task, p)
    t = Trajectory(prompt_ids=encode_prompt(tok, p.text))
    t.extend(tok.encode(call), [-0.1] * len(tok.encode(call)), generated=True)
    t.extend(encode_tool_result(tok, result), None, generated=False)
    t.extend(tok.encode(answer) + [tok.eos_id], [-0.1] * (len(tok.encode(answer)) + 1), generated=True)
    t.num_turns, t.finished, t.turn_versions = 2, True, [[3, 3], [4, 4]]
    text = tok.decode(t.response_ids)
    sample = build_rollout_sample(sample_id="s", epoch=0, param_version=3, producer="rollout_00",
                                  trajectories=[t], rewards=[task.reward(p, text)], raw_prompt=p.text,
                                  ground_truth=p.answer, tokenizer=tok, tool_calls=[0.0], rollout_status={})
    row = decode_texts(sample, tok)[0]
    assert row["reward"] == 1.0
    assert row["turns"] == [
        {"role": "model", "trained": True, "text": call},
        {"role": "tool", "trained": False, "text": tok.decode(encode_tool_result(tok, result))},
        {"role": "model", "trained": True, "text": answer},
    ]
    assert sample.agent_loop_output_list[0]["turn_versions"] == [[3, 3], [4, 4]]


def test_the_warm_start_on_a_tiny_hf_model_learns_the_call_format(tmp_path: Path) -> None:
    from rollstream.tasks.tool_warmstart import fold_lora, save_hf_model, tool_warm_start, trace_rows

    model_dir = make_tiny_hf_model(tmp_path / "m", seed=0, arch="qwen2", tokenizer="bpe", chat_template=True,
                                   hidden_size=64, max_positions=256)
    one_digit = [f"data.task_args.{k}" for k in ("min_terms=2", "max_terms=2", "min_digits=1", "max_digits=1",
                                                  "allow_parentheses=false", "allow_negation=false")]
    cfg = load_config(None, [*TOOL, f"model.hf_path={model_dir}", "data.instruction=", "data.val_size=16",
                             "data.max_response_length=16", "run.seed=3", *one_digit,
                             "data.task_args.operators=['+', '-', '*']"])
    task = build_task(cfg)
    assert isinstance(task, CalculatorTask)
    with pytest.raises(ValueError, match="traces=33"):
        tool_warm_start(cfg, traces=33)
    _, before = tool_warm_start(cfg, traces=1, max_steps=0)
    assert before.call_rate == 0.0 and before.val_acc == 0.0  # the random model never calls
    # full fine-tuning (rank 0): LoRA factors on a random 2-layer model learn too slowly for a test
    policy, report = tool_warm_start(cfg, traces=32, max_steps=150, lr=3e-3, rank=0, micro_batch=32)
    assert report.steps == 150 and report.traces == 32 and report.cpu_s <= 120
    # the tool's tokens carry no loss: only the call (with its turn's end) and the answer are trained
    p_ids, r_ids, masks = trace_rows(task, policy, [task.make_prompt(random.Random(1))])
    tok = policy.tokenizer
    trained = tok.decode([i for i, m in zip(r_ids[0], masks[0], strict=True) if m], skip_special=False)
    assert trained.startswith("[calc: ") and "[=" not in trained and "<|tool|>" not in trained
    # the held-out report ran through the tool loop: the model calls, and the calls hold the expression
    assert report.call_rate >= 0.75 and report.right_expr >= 0.5, report
    assert report.val_acc >= 0.25, report
    assert fold_lora(policy.module) == 0  # folded already: a plain model
    folder = save_hf_model(policy, tmp_path / "warm")
    reloaded = load_config(None, [*TOOL, f"model.hf_path={folder}", "data.instruction=", "data.val_size=16"])
    from rollstream.model import build_policy

    again = build_policy(reloaded)
    eps = greedy_episodes(again, task, p_ids, 16, 3)
    assert tok.decode(eps[0].response_ids).startswith("[calc: ")


class SwapBetweenTurns:
    """A VersionSource whose newer version appears between the first turn and the second."""

    def __init__(self) -> None:
        self.version = 0
        self.asked = 0

    def refresh(self) -> bool:
        """Version 1 from the second call on (the first refresh is the one between the turns)."""
        self.asked += 1
        if self.version == 0:
            self.version = 1
            return True
        return False


def episode_samples(tmp_path: Path) -> tuple[Any, list[Any], Any]:
    """A tiny HF model's config and two samples of one scripted tool episode group (one right, one wrong),
    the second's behaviour log-probs at the tool's tokens changed from 0 to -30; and the trajectories."""
    from producers.agent import GenerationSettings, run_agent_loop
    from producers.rollout import build_rollout_sample, generation_request

    model_dir = make_tiny_hf_model(tmp_path / "m", seed=0, arch="qwen2", tokenizer="bpe", chat_template=True,
                                   max_positions=256)
    cfg = load_config(None, [*TOOL, f"model.hf_path={model_dir}", "data.instruction=", "run.device=cpu",
                             "rollout.n=2", "actor.ppo_mini_batch_size=1", "data.train_batch_size=1",
                             "async_training.trigger_parameter_sync_step=1",
                             "actor.optim.lr=1e-2", "async_training.partial_rollout=true"])
    task = build_task(cfg)
    tok = HFTokenizer(build_tokenizer("bpe", chat_template=True))
    p = a_prompt(task)  # type: ignore[arg-type]
    weights = SwapBetweenTurns()
    policy = ScriptedCalculator(tok, wrong_on="\x00")
    request = generation_request([p], 2, True, tok)
    trajs = run_agent_loop(policy, task, request, GenerationSettings(16, partial_rollout=True, max_turns=3),  # type: ignore[arg-type]
                           weights)
    last = tok.decode([trajs[1].response_ids[-2]])  # the answer's last digit: the second answers wrong
    trajs[1].response_ids[-2] = tok.encode("1" if last != "1" else "2")[0]
    samples = []
    for behave_tool in (0.0, -30.0):
        for t in trajs:
            t.log_probs = [-0.5 if m else behave_tool for m in t.response_mask]
        texts = [tok.decode(t.response_ids) for t in trajs]
        samples.append(build_rollout_sample(
            sample_id="s", epoch=0, param_version=0, producer="rollout_00", trajectories=trajs,
            rewards=[task.reward(p, x) for x in texts], raw_prompt=p.text, ground_truth=p.answer,
            tokenizer=tok, tool_calls=[0.0, 0.0], rollout_status={}))
    return cfg, samples, trajs


def test_a_swap_between_turns_is_stamped_per_turn_and_tool_tokens_never_enter_the_loss(
    tmp_path: Path,
) -> None:
    import torch

    from consumers.trainer.assembly import assemble_batch_from_rollout_samples
    from consumers.trainer.learner import Learner

    cfg, (plain, shifted), trajs = episode_samples(tmp_path)
    for t in trajs:  # turn 1 under version 0, the swap between the turns, turn 2 under version 1
        assert t.num_turns == 2 and t.turn_versions == [[0, 0], [1, 1]]
        assert (t.version_start, t.version_end) == (0, 1)
        assert 0 in t.response_mask and t.log_probs[t.response_mask.index(0)] == -30.0
    assert [o["turn_versions"] for o in plain.agent_loop_output_list] == [[[0, 0], [1, 1]]] * 2
    assert plain.param_version_start == [0, 0] and plain.param_version_end == [1, 1]
    assert [o["exact"] for o in plain.agent_loop_output_list] == [True, False]

    def updated(sample: Any) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        learner = Learner(cfg)
        batch, _ = assemble_batch_from_rollout_samples([sample])
        learner.update(batch)
        return {k: v.detach().clone() for k, v in learner.policy.module.state_dict().items()}

    a, b = updated(plain), updated(shifted)
    # behaviour log-probs of -30 at the tool's tokens would make their ratio e^30: the update is the same
    assert all(torch.equal(a[k], b[k]) for k in a)
    # while one trained token's behaviour log-prob changes it (the check can fail)
    other = plain.model_copy(deep=True)
    other.full_batch.tokens["rollout_log_probs"][0] = -3.0
    c = updated(other)
    assert any(not torch.equal(a[k], c[k]) for k in a)
