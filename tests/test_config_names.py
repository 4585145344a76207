"""verl's config names, and the old ones kept for one release: an old key gives the config its new key gives,
with one deprecation line naming the new key; `rollstream config` prints only the new form."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollstream.config import ConfigError, config_to_yaml, load_config
from rollstream.config import deprecated as deprecated_module
from rollstream.config.deprecated import ALIASES

ROOT = Path(__file__).resolve().parent.parent
HF = ["model.backend=hf", "model.hf_path=/nowhere"]

#: (old override, the same setting under its new key(s), the new key the message names, overrides both
#: need)
RENAMES: list[tuple[str, list[str], str, list[str]]] = [
    ("actor.lr=0.01", ["actor.optim.lr=0.01"], "actor.optim.lr", []),
    ("actor.weight_decay=0.1", ["actor.optim.weight_decay=0.1"], "actor.optim.weight_decay", []),
    ("actor.grad_clip=0.5", ["actor.optim.clip_grad=0.5"], "actor.optim.clip_grad", []),
    ("actor.kl_coef=0.1", ["actor.kl_loss_coef=0.1"], "actor.kl_loss_coef", []),
    ("actor.entropy_coef=0.01", ["actor.entropy_coeff=0.01"], "actor.entropy_coeff", []),
    ("actor.adv_estimator=grpo_token", ["algorithm.adv_estimator=grpo_token"], "algorithm.adv_estimator", []),
    ("actor.gamma=0.5", ["algorithm.gamma=0.5"], "algorithm.gamma", []),
    (
        "actor.norm_adv_by_std=false",
        ["algorithm.norm_adv_by_std_in_grpo=false"],
        "algorithm.norm_adv_by_std_in_grpo",
        [],
    ),
    ("actor.norm_adv_by_mean=true", ["algorithm.norm_adv_by_mean=true"], "algorithm.norm_adv_by_mean", []),
    (
        "actor.rollout_correction.rollout_is=sequence",
        ["algorithm.rollout_correction.rollout_is=sequence"],
        "algorithm.rollout_correction",
        [],
    ),
    (
        "actor.off_policy_mode=bypass",
        ["algorithm.rollout_correction.bypass_mode=true"],
        "algorithm.rollout_correction.bypass_mode",
        [],
    ),
    (
        "actor.behave_imp_cap=3",
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=3",
        ],
        "algorithm.rollout_correction.rollout_is_threshold",
        [],
    ),
    (
        "trainer.filter_groups.enable=true",
        ["algorithm.filter_groups.enable=true"],
        "algorithm.filter_groups",
        [],
    ),
    ("trainer.total_global_steps=7", ["trainer.total_training_steps=7"], "trainer.total_training_steps", []),
    (
        "trainer.parameter_sync_step=4",
        ["async_training.trigger_parameter_sync_step=4"],
        "async_training.trigger_parameter_sync_step",
        ["data.train_batch_size=32"],
    ),
    (
        "rollout.staleness_threshold=0.5",
        ["async_training.staleness_threshold=0.5"],
        "async_training.staleness_threshold",
        [],
    ),
    (
        "rollout.partial_rollout=false",
        ["async_training.partial_rollout=false"],
        "async_training.partial_rollout",
        [],
    ),
    ("rollout.engine=vllm", ["rollout.name=vllm"], "rollout.name", HF),
    (
        "rollout.latency_model.enable=true",
        ["bench.latency_model.enable=true"],
        "bench.latency_model",
        [],
    ),
    ("data.min_digits=2", ["data.reverse.min_digits=2"], "data.reverse.min_digits", []),
    ("data.max_digits=4", ["data.reverse.max_digits=4"], "data.reverse.max_digits", []),
    ("data.fixed_width=true", ["data.reverse.fixed_width=true"], "data.reverse.fixed_width", []),
]


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the deprecation lines its own loads log (they are logged once per process)."""
    monkeypatch.setattr(deprecated_module, "_noted", set())


def nested(overrides: list[str]) -> dict[str, Any]:
    """The YAML mapping the dotted overrides stand for."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, _, text = item.partition("=")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(text)
    return out


def test_every_deprecated_key_is_checked_here() -> None:
    checked = [old.partition("=")[0] for old, *_ in RENAMES]
    unchecked = [a.old for a in ALIASES if not any(k == a.old or k.startswith(a.old + ".") for k in checked)]
    assert unchecked == []


@pytest.mark.parametrize(("old", "new", "named", "both"), RENAMES, ids=[r[0] for r in RENAMES])
def test_an_old_key_gives_the_config_of_its_new_key_and_names_it_once(
    old: str, new: list[str], named: str, both: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    expected = config_to_yaml(load_config(None, both + new))
    assert caplog.messages == []  # the new names log nothing
    assert config_to_yaml(load_config(None, both + [old])) == expected  # on the command line
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(nested(both + [old])))
    assert config_to_yaml(load_config(path)) == expected  # in pipeline.yaml
    old_key = old.partition("=")[0]
    lines = [m for m in caplog.messages if "deprecated" in m]
    assert len(lines) == 1, lines  # once, though read twice
    assert lines[0].startswith("config key ") and lines[0].endswith(f"is deprecated: use {named}")
    assert old_key.startswith(lines[0].split()[2])  # and naming the old key (or its old section)


def test_an_old_key_and_its_new_key_in_one_file_are_refused_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("actor:\n  lr: 0.1\n  optim:\n    lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"actor\.lr is the old name of actor\.optim\.lr: set one"):
        load_config(path)


def test_an_override_wins_over_the_file_whichever_names_either_uses(tmp_path: Path) -> None:
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("actor:\n  lr: 0.1\n")
    new.write_text("actor:\n  optim:\n    lr: 0.1\n")
    assert load_config(old, ["actor.optim.lr=0.2"]).actor.optim.lr == 0.2
    assert load_config(new, ["actor.lr=0.2"]).actor.optim.lr == 0.2


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("actor.optim.lrr=1", "actor.optim.lrr: unknown key"),
        ("algorithm.lam=0.95", "algorithm.lam: unknown key"),  # no critic, no GAE: refused, not ignored
        ("async_training.require_batches=2", "async_training.require_batches: unknown key"),
        ("actor.off_policy_mode=sideways", "actor.off_policy_mode='sideways' must be decoupled or bypass"),
    ],
)
def test_an_unknown_key_still_errors_naming_the_field(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_rollstream_config_prints_the_new_names_of_an_old_config(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(
        "data: {train_batch_size: 16, min_digits: 2}\n"
        "rollout: {engine: builtin, staleness_threshold: 1.0, partial_rollout: false}\n"
        "actor: {ppo_mini_batch_size: 8, lr: 0.001, adv_estimator: grpo_token, off_policy_mode: bypass}\n"
        "trainer: {parameter_sync_step: 2, total_global_steps: 9, filter_groups: {enable: true}}\n"
    )
    p = subprocess.run(
        [sys.executable, "-m", "rollstream.cli", "config", str(path), "actor.grad_clip=0.5"],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )
    printed = yaml.safe_load(p.stdout)
    assert printed["async_training"] == {
        "staleness_threshold": 1.0, "trigger_parameter_sync_step": 2, "partial_rollout": False
    }
    assert printed["actor"]["optim"] == {
        "lr": 0.001, "weight_decay": 0.0, "clip_grad": 0.5, "master_weights": False, "fused": None
    }
    assert printed["algorithm"]["adv_estimator"] == "grpo_token"
    assert printed["algorithm"]["rollout_correction"]["bypass_mode"] is True
    assert printed["algorithm"]["filter_groups"] == {"enable": True}
    assert printed["trainer"]["total_training_steps"] == 9 and printed["rollout"]["name"] == "builtin"
    assert printed["data"]["reverse"]["min_digits"] == 2
    assert "bench" not in printed  # benchmark-only settings are no part of a run's config
    old_names = {"lr", "grad_clip", "adv_estimator", "off_policy_mode", "parameter_sync_step",
                 "total_global_steps", "filter_groups", "engine", "staleness_threshold", "min_digits"}
    for section in ("data", "rollout", "actor", "trainer"):
        assert old_names.isdisjoint(printed[section]), section
    notes = p.stderr.strip().splitlines()
    assert len(notes) == 11 and len(set(notes)) == 11  # one line an old key
    assert "config key actor.grad_clip is deprecated: use actor.optim.clip_grad" in notes
    assert "config key trainer.total_global_steps is deprecated: use trainer.total_training_steps" in notes


def test_benchmark_settings_are_printed_only_where_a_benchmark_set_them() -> None:
    assert "bench:" not in config_to_yaml(load_config(None))
    modelled = load_config(None, ["bench.latency_model.enable=true"])
    assert yaml.safe_load(config_to_yaml(modelled))["bench"]["latency_model"]["enable"] is True
    assert load_config(None, ["bench.latency_model.enable=true"]).rollout == load_config(None).rollout
