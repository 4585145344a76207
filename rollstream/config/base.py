"""What every config section shares: unknown keys refused, assignments validated, one error type."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(Exception):
    """A pipeline.yaml or override that does not validate; the message names field, value and rule."""


class Section(BaseModel):
    """A config section: unknown keys are errors (naming the key), assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
