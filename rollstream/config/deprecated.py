"""Old config keys, kept working for one release: each is read as its new key, with a one-line deprecation
message naming the new key (logged once per process). `rollstream config` prints only the new form."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


def _off_policy_mode(value: Any) -> bool:
    modes = {"decoupled": False, "bypass": True}
    if value not in modes:
        raise ValueError(
            f"actor.off_policy_mode={value!r} must be decoupled or bypass "
            "(its new key: algorithm.rollout_correction.bypass_mode=false|true)"
        )
    return modes[value]


@dataclass(frozen=True)
class Alias:
    """`old` (a dotted key or section) now reads as `new`; `convert` maps an old value to the new key's,
    `also` sets sibling keys of `new` the old key implied."""

    old: str
    new: str
    convert: Callable[[Any], Any] = lambda value: value
    also: dict[str, Any] = field(default_factory=dict)


#: Every renamed key, old -> new (verl's names; task keys under their task; benchmark keys under bench).
ALIASES: tuple[Alias, ...] = (
    Alias("actor.lr", "actor.optim.lr"),
    Alias("actor.weight_decay", "actor.optim.weight_decay"),
    Alias("actor.grad_clip", "actor.optim.clip_grad"),
    Alias("actor.kl_coef", "actor.kl_loss_coef"),
    Alias("actor.entropy_coef", "actor.entropy_coeff"),
    Alias("actor.adv_estimator", "algorithm.adv_estimator"),
    Alias("actor.gamma", "algorithm.gamma"),
    Alias("actor.norm_adv_by_std", "algorithm.norm_adv_by_std_in_grpo"),
    Alias("actor.norm_adv_by_mean", "algorithm.norm_adv_by_mean"),
    Alias("actor.rollout_correction", "algorithm.rollout_correction"),
    Alias("actor.off_policy_mode", "algorithm.rollout_correction.bypass_mode", convert=_off_policy_mode),
    Alias(
        "actor.behave_imp_cap",
        "algorithm.rollout_correction.rollout_is_threshold",
        also={"rollout_is": "token"},
    ),
    Alias("trainer.filter_groups", "algorithm.filter_groups"),
    Alias("trainer.total_global_steps", "trainer.total_training_steps"),
    Alias("trainer.parameter_sync_step", "async_training.trigger_parameter_sync_step"),
    Alias("rollout.staleness_threshold", "async_training.staleness_threshold"),
    Alias("rollout.partial_rollout", "async_training.partial_rollout"),
    Alias("rollout.engine", "rollout.name"),
    Alias("rollout.latency_model", "bench.latency_model"),
    Alias("data.min_digits", "data.reverse.min_digits"),
    Alias("data.max_digits", "data.reverse.max_digits"),
    Alias("data.fixed_width", "data.reverse.fixed_width"),
)

_noted: set[str] = set()


def _note(alias: Alias) -> None:
    if alias.old not in _noted:
        _noted.add(alias.old)
        log.warning("config key %s is deprecated: use %s", alias.old, alias.new)


def renamed(path: str, value: Any) -> list[tuple[str, Any]]:
    """The (key, value) settings an override `path=value` stands for: itself, or its new key(s) when `path`
    is (or lies in) a deprecated key."""
    for alias in ALIASES:
        if path == alias.old:
            _note(alias)
            parent = alias.new.rpartition(".")[0]
            return [(alias.new, alias.convert(value))] + [(f"{parent}.{k}", v) for k, v in alias.also.items()]
        if path.startswith(alias.old + "."):
            _note(alias)
            return [(alias.new + path.removeprefix(alias.old), value)]
    return [(path, value)]


def _section(data: dict[str, Any], path: str) -> tuple[dict[str, Any] | None, str]:
    """The section holding `path`'s last part (None when absent), and that part."""
    *parents, leaf = path.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _put(data: dict[str, Any], path: str, value: Any, old: str, verb: str = "is the old name of") -> None:
    """Set `path` to `value` (a section merged key by key), refusing a key already set."""
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{old} {verb} {path}, but {part} there is not a section")
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        for key, item in value.items():
            _put(data, f"{path}.{key}", item, f"{old}.{key}", verb)
    elif leaf in node:
        raise ValueError(f"{old} {verb} {path}: set one")
    else:
        node[leaf] = value


def translate(data: dict[str, Any]) -> dict[str, Any]:
    """A raw config with every deprecated key moved to its new key (a copy when any moved); both an old key
    and its new one set is an error naming the two."""
    out = data
    for alias in ALIASES:
        section, leaf = _section(out, alias.old)
        if section is None or leaf not in section:
            continue
        if out is data:
            out = copy.deepcopy(data)
            section, leaf = _section(out, alias.old)
            assert section is not None
        value = section.pop(leaf)
        _note(alias)
        _put(out, alias.new, alias.convert(value), alias.old)
        parent = alias.new.rpartition(".")[0]
        for key, item in alias.also.items():
            _put(out, f"{parent}.{key}", item, alias.old, "also sets")
    return out
