"""The trainer consumer: rollouts -> decoupled-PPO local updates -> one weight publish per global step.

Run it as `python -m consumers.trainer pipeline.yaml [key=value ...] [--name trainer]`. Importing the
package is cheap (torch loads with `loop`/`assembly`), so `__main__` can install its signal handlers first.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer", "assemble_batch_from_rollout_samples"]


def __getattr__(name: str) -> Any:
    """Lazy access to Trainer and assemble_batch_from_rollout_samples (they import torch)."""
    if name == "Trainer":
        from consumers.trainer.loop import Trainer

        return Trainer
    if name == "assemble_batch_from_rollout_samples":
        from consumers.trainer.assembly import assemble_batch_from_rollout_samples

        return assemble_batch_from_rollout_samples
    raise AttributeError(name)
