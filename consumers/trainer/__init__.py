"""The trainer consumer: rollouts -> decoupled-PPO local updates -> one weight publish per global step.

Run it as `python -m consumers.trainer pipeline.yaml [key=value ...] [--name trainer]`.
"""

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.loop import Trainer

__all__ = ["Trainer", "assemble_batch_from_rollout_samples"]
