"""A local update's metrics, built here alone: `update_metrics` names what Learner.update measured (raw
values: `UpdateStats`, one `EpochStats` per epoch) as its `actor/`, `critic/`, length, `perf/` and
`timing_s/update_actor` metrics, merging the epochs' (`merge_epochs`); `local_update_metrics` puts those
together with the batch's, the collection's, the run's stale counters and the timings, for the
`local_update` event (step_report.local_update_event)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from consumers.trainer.staleness import (
    ROLLOUT_FAILURE_EVICTED,
    count_stale,
    dropped_metrics,
    filter_groups_metrics,
)
from rollstream.rl.metrics import response_length_metrics, reward_metrics, staleness_metrics
from rollstream.rl.rollout_correction import PREFIX
from schemas import RolloutSample

if TYPE_CHECKING:
    from consumers.trainer.collect import Collected

#: Metric of a local update: 1 when its optimizer step was skipped (non-finite loss or gradient), else 0.
UPDATE_SKIPPED = "actor/update_skipped"
#: Metric of a local update of several epochs (actor.ppo_epochs > 1): how many of their steps were skipped.
EPOCHS_SKIPPED = "actor/epochs_skipped"
#: The policy-gradient loss among ppo_loss's metrics: aggregated like the loss, the others are token means.
PG_LOSS = "actor/pg_loss"


@dataclass
class EpochStats:
    """What one epoch of a local update measured (Learner._accumulate, then Learner._step)."""

    #: per micro-batch: ppo_loss's metrics, its share of this rank's loss and its share of the loss tokens
    micro: list[tuple[dict[str, float], float, float]]
    loss: float  # this rank's loss (actor.loss_agg_mode), entropy and KL terms included
    entropy: float  # the entropy, aggregated over the trained rows
    entropy_coef: float  # the entropy coefficient at this global step (0: off)
    kl: float | None  # the KL loss against the reference policy (None without one)
    kl_coef: float  # actor.kl_loss_coef
    update_s: float  # seconds in the micro-batches' forwards and backwards
    mismatch: dict[str, float] | None = None  # (first epoch) the sampler against the policy before it
    grad_norm: float = 0.0  # the gradient norm before clipping
    skipped: bool = False  # the optimizer step was skipped (non-finite loss or norm on any rank)
    step_s: float = 0.0  # seconds in the optimizer step


@dataclass
class UpdateStats:
    """What one local update measured (Learner.update): its epochs and the mini-batch's raw values."""

    epochs: list[EpochStats]
    rows: int  # rows of the mini-batch
    kept: int  # rows trained (zero-advantage rows left out: fewer)
    pad_s: float  # seconds padding the trained rows (MiniBatch.padded)
    before_s: float  # seconds of the forward run ahead and the rollout correction, before the epochs
    old_logprob_s: float | None  # seconds of the frozen copies' log-probs (None without prox or ref)
    norm_factor: float | None  # the IS weights' batch normalisation factor (None when not normalised)
    lr: float  # the optimizer's learning rate
    rewards: torch.Tensor  # [B] on the CPU
    adv_mean: float  # the advantages' mean
    row_tokens: torch.Tensor  # [B] float64 on the CPU: each row's prompt + response tokens
    response_tokens: torch.Tensor  # [B] float64 on the CPU: each row's loss tokens (its response mask's sum)
    max_response_length: int  # data.max_response_length


def epoch_metrics(e: EpochStats, left_out: bool, norm_factor: float | None) -> dict[str, float]:
    """One epoch's metrics: ppo_loss's (the loss share-weighted, the rest token means), the mismatch metrics
    (first epoch), entropy, KL, loss, timing, gradient norm and whether its step was skipped."""
    metrics: dict[str, float] = {}
    for pg, share, tok_share in e.micro:
        for k, v in pg.items():
            metrics[k] = metrics.get(k, 0.0) + v * (share if k == PG_LOSS else tok_share)
    if e.mismatch is not None:
        metrics.update(e.mismatch)
        if norm_factor is not None:
            metrics[PREFIX + "rollout_is_batch_norm_factor"] = norm_factor
    if left_out:
        metrics.setdefault(PG_LOSS, 0.0)  # nothing trained: every row's loss was 0
    if e.entropy_coef > 0:
        metrics["actor/entropy_coef"] = e.entropy_coef
    if e.kl is not None:
        metrics["actor/kl_loss"] = e.kl
        metrics["actor/kl_coef"] = e.kl_coef
    metrics.update({"actor/loss": e.loss, "actor/entropy": e.entropy, "timing_s/update_actor": e.update_s})
    metrics.update({"actor/grad_norm": e.grad_norm, UPDATE_SKIPPED: float(e.skipped)})
    metrics["timing_s/update_actor"] += e.step_s
    return metrics


def merge_epochs(epochs: list[dict[str, float]]) -> dict[str, float]:
    """One local update's metrics from its epochs' (actor.ppo_epochs): timings summed; skipped only when every
    epoch's optimizer step was, with `actor/epochs_skipped` counting those that were (several epochs); every
    other metric the mean over the epochs that stepped (over all when none did), or the one epoch's that has
    it (the mismatch metrics: the first's)."""
    if len(epochs) == 1:
        return dict(epochs[0])
    stepped = [e for e in epochs if not e.get(UPDATE_SKIPPED)] or epochs
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for e in epochs for k in e):
        if key.startswith("timing_s/"):
            out[key] = sum(e.get(key, 0.0) for e in epochs)
        elif key == UPDATE_SKIPPED:
            out[key] = float(all(e[key] > 0 for e in epochs))
        else:
            values = [e[key] for e in stepped if key in e] or [e[key] for e in epochs if key in e]
            out[key] = values[0] if len(values) == 1 else sum(values) / len(values)
    out[EPOCHS_SKIPPED] = float(sum(1 for e in epochs if e.get(UPDATE_SKIPPED)))
    return out


def update_metrics(u: UpdateStats) -> dict[str, float]:
    """A local update's metrics from what it measured, in this order: the epochs' merged (`merge_epochs`),
    the share of rows trained (when some were left out), the learning rate, reward spread, advantage mean,
    token and sequence-length spread, the frozen copies' seconds, then rl/metrics.py's reward and length
    metrics."""
    left_out = u.kept < u.rows
    metrics = merge_epochs([epoch_metrics(e, left_out, u.norm_factor) for e in u.epochs])
    metrics["timing_s/update_actor"] += u.pad_s + u.before_s
    if left_out:
        metrics["actor/trained_row_fraction"] = u.kept / u.rows
    tokens = u.row_tokens
    metrics.update(
        {
            "actor/lr": u.lr,
            "critic/rewards/std": float(u.rewards.std()) if u.rewards.numel() > 1 else 0.0,
            "critic/advantages/mean": u.adv_mean,
            "perf/total_num_tokens": float(tokens.sum()),
            "global_seqlen/min": float(tokens.min()),
            "global_seqlen/max": float(tokens.max()),
            "global_seqlen/minmax_diff": float(tokens.max() - tokens.min()),
        }
    )
    if u.old_logprob_s is not None:
        metrics["timing_s/old_log_prob"] = u.old_logprob_s
    metrics.update(reward_metrics(u.rewards))
    metrics.update(response_length_metrics(u.response_tokens, u.max_response_length))
    return metrics


@dataclass(frozen=True)
class UpdateTimings:
    """A local update's seconds: waiting for and taking its samples (`gen`), assembling their rows and the
    batch's metrics (`assemble`; the padding is the update's, in timing_s/update_actor), and moving them
    out of Redis (`transport`, the reader's since the last update: collect.py)."""

    gen: float
    assemble: float
    transport: float


def collected_metrics(
    got: Collected, filter_groups: bool
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(metrics, counts) of a local update's collection: the samples dropped as stale, the filter_groups
    evictions (when on), the rollout failures evicted and the staleness of the samples kept."""
    metrics = dropped_metrics(got.dropped)
    fg_metrics, fg_counts = filter_groups_metrics(got.evicted) if filter_groups else ({}, {})
    metrics.update(fg_metrics)
    metrics[ROLLOUT_FAILURE_EVICTED] = float(got.failed)
    metrics.update(staleness_metrics([st for _, st in got.kept]))
    return metrics, fg_counts


def local_update_metrics(
    g: int,
    got: Collected,
    learned: dict[str, float],
    batch_metrics: dict[str, float],
    trajectory_versions: Sequence[int],
    counters: dict[str, int],
    timings: UpdateTimings,
    filter_groups: bool,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(metrics, filter_groups counts) of a local update of step g, in this order (a later part wins a name
    they share): the learner's (`update_metrics`), the batch's (`fully_async/` processing times, tool calls,
    partial rollouts: assembly.py), the collection's (`collected_metrics`), the run's stale counters
    (advanced here by the kept samples and their `trajectory_versions`: staleness.count_stale), then the step
    and the timings."""
    samples: list[RolloutSample] = [m.event for m, _ in got.kept]  # type: ignore[misc]
    metrics = {**learned, **batch_metrics}
    got_metrics, fg_counts = collected_metrics(got, filter_groups)
    metrics.update(got_metrics)
    metrics.update(count_stale(counters, g - 1, samples, trajectory_versions))
    metrics.update({"training/global_step": float(g), "timing_s/gen": timings.gen,
                    "timing_s/assemble": timings.assemble, "timing_s/transport": timings.transport,
                    "fully_async/total_wait_time": timings.gen})  # fmt: skip
    return metrics, fg_counts
