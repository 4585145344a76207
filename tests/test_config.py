"""pipeline.yaml model: defaults, overrides, cross-field rules and readable errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.config import ConfigError, PipelineConfig, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_pipeline_yaml_loads() -> None:
    cfg = load_config(ROOT / "pipeline.yaml")
    sync_step = cfg.async_training.trigger_parameter_sync_step
    assert cfg.data.train_batch_size == sync_step * cfg.actor.ppo_mini_batch_size


def test_shipped_configs_load_and_differ_from_the_demo_only_in_their_levers() -> None:
    demo = load_config(ROOT / "pipeline.yaml")
    hard = load_config(ROOT / "configs" / "reverse-variable.yaml")
    assert (
        hard.data.reverse.fixed_width is False
        and hard.algorithm.adv_estimator == "grpo_token"
        and hard.algorithm.gamma == 0.0
    )
    assert hard.rollout.temperature == 2.0 and hard.actor.entropy_coeff == 0.01
    assert hard.model.position == "learned+rope" and demo.model.position == "learned"  # a lever, the only one
    same_model = hard.model.model_copy(update={"position": "learned"})
    assert (same_model, hard.data.train_batch_size, hard.rollout.n) == (
        demo.model,
        demo.data.train_batch_size,
        demo.rollout.n,
    )


def test_smollm2_config_reads_the_pretrained_model_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    path = ROOT / "configs" / "smollm2-basic-arithmetic.yaml"
    monkeypatch.setenv("ROLLSTREAM_MODEL_CACHE", "/models")
    cfg = load_config(path)  # model.pretrained names the folder `rollstream model build` writes
    assert cfg.model.hf_path == "/models/smollm2-135m-instruct" and cfg.model.dtype == "fast"
    assert cfg.actor.optim.master_weights
    assert cfg.data.task == "rg:basic_arithmetic" and cfg.rollout.name == "builtin"
    assert cfg.data.task_args["operators"] == ["+", "-", "*"]  # '/' items are wrong: see config
    explicit = load_config(path, ["model.hf_path=/elsewhere"])
    assert explicit.model.hf_path == "/elsewhere"  # an explicit folder wins
    with pytest.raises(ConfigError, match="unknown model 'smollm3'.*smollm2-135m-instruct"):
        load_config(path, ["model.pretrained=smollm3"])
    with pytest.raises(ConfigError, match="pretrained='smollm2-135m-instruct' needs backend=hf"):
        load_config(None, ["model.pretrained=smollm2-135m-instruct"])


def test_overrides_are_typed() -> None:
    cfg = load_config(
        None,
        [
            "async_training.trigger_parameter_sync_step=4",
            "data.train_batch_size=32",
            "async_training.partial_rollout=false",
            "rollout.temperature=0.7",
            "rollout.multi_turn.enable=true",
            "run.redis_url=redis://h:1/2",
        ],
    )
    assert cfg.async_training.trigger_parameter_sync_step == 4
    assert cfg.async_training.partial_rollout is False
    assert cfg.rollout.temperature == 0.7
    assert cfg.rollout.multi_turn.enable is True
    assert cfg.run.redis_url == "redis://h:1/2"


def test_bad_train_batch_size_names_all_three() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.train_batch_size=10"])
    msg = str(e.value)
    assert "data.train_batch_size=10" in msg
    assert "async_training.trigger_parameter_sync_step=2" in msg
    assert "actor.ppo_mini_batch_size=8" in msg


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("trainer.max_off_policy_threshold=0", "max_off_policy_threshold=0"),
        ("async_training.staleness_threshold=-1", "async_training.staleness_threshold=-1"),
        ("rollout.n=zero", "rollout.n='zero'"),
        ("trainer.no_such_key=1", "trainer.no_such_key: unknown key"),
        ("bus.block_ms=20000", "socket_timeout_s"),
        (
            "trainer.nproc_per_node=3",
            "actor.ppo_mini_batch_size=8 must be divisible by the trainer world size "
            "trainer.nnodes=1 * trainer.nproc_per_node=3 (= 3)",
        ),
        ("trainer.nnodes=2", "trainer.nnodes=2 needs trainer.rdzv_endpoint"),
        ("trainer.strategy=zero3", "trainer.strategy='zero3'"),
        ("rollout.top_k=0", "rollout.top_k=0"),
        ("rollout.top_k=-2", "rollout.top_k"),
    ],
)
def test_bad_values_are_named(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(None, ["nonsense"])


def test_every_field_has_a_description() -> None:
    def walk(model: type) -> list[str]:
        missing = []
        for name, f in model.model_fields.items():  # type: ignore[attr-defined]
            if not f.description:
                missing.append(f"{model.__name__}.{name}")
            ann = f.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                missing += walk(ann)
        return missing

    assert walk(PipelineConfig) == []


def test_cli_error_has_no_traceback() -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollstream.cli",
            "config",
            str(ROOT / "pipeline.yaml"),
            "data.train_batch_size=3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "data.train_batch_size=3" in p.stderr
