"""Reading a run's config: pipeline.yaml plus dotted overrides, validated into a PipelineConfig, and back
to YAML."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rollstream.config.base import ConfigError
from rollstream.config.deprecated import renamed, translate
from rollstream.config.pipeline import PipelineConfig


def _format_error(err: ValidationError, data: dict[str, Any]) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key (value {e['input']!r})")
        elif loc and isinstance(e["input"], dict):  # a section's own check: its message names the fields
            lines.append(msg if msg.startswith(f"{loc}.") else f"{loc}: {msg}")
        elif loc:
            lines.append(f"{loc}={e['input']!r}: {msg}")
        else:
            lines.append(msg)
    return "invalid config: " + "; ".join(lines)


def _parse_scalar(text: str) -> Any:
    # YAML scalar rules give ints, floats, bools and null; the model then types them. YAML 1.1 reads
    # "0.5_2" as the number 0.52: a value with an underscore stays text (the model still parses 1_000).
    if "_" in text:
        return text
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted `a.b.c=value` overrides to a raw config dict (values parsed as YAML scalars; deprecated
    keys move to their new ones first, in `data` and in the overrides, so an override always wins)."""
    try:
        data = translate(data)
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from None
    for item in overrides:
        m = re.fullmatch(r"([A-Za-z_][\w.]*)=(.*)", item, flags=re.S)
        if not m:
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        try:
            settings = renamed(m.group(1), _parse_scalar(m.group(2)))
        except ValueError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        for key, value in settings:
            *parents, leaf = key.split(".")
            node = data
            for part in parents:
                nxt = node.setdefault(part, {})
                if not isinstance(nxt, dict):
                    raise ConfigError(f"override {item!r}: {part} is not a section")
                node = nxt
            node[leaf] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Load pipeline.yaml (or defaults when path is None), apply overrides, validate; raise ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, list(overrides or []))
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, data)) from None


def config_to_yaml(cfg: PipelineConfig) -> str:
    """The resolved config as YAML (logged at start, written into the run dir); `bench:` only when set."""
    data = cfg.model_dump(mode="json", exclude={"bench"} if "bench" not in cfg.model_fields_set else None)
    return yaml.safe_dump(data, sort_keys=False)

