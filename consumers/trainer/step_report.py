"""What a global step records and reports: each local update's fates and its `local_update` event (its
metrics: consumers/trainer/metrics.py); at the end, every rank's report and what rank 0
builds from them (the `step_end` event and the checkpoint metadata). A world of one gathers its own report:
the collective's identity case."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from consumers.trainer.checkpoint import rng_plain
from consumers.trainer.distributed import DataParallel
from consumers.trainer.ledger import StepLedger
from consumers.trainer.staleness import LengthBuckets
from rollstream.bus import Message
from rollstream.rl.metrics import finite_metrics
from rollstream.tasks import Prompt
from rollstream.weights.store import Probe
from schemas import DROPPED, SKIPPED, TRAINED, Fate, StepMetrics


def record_fates(ledger: StepLedger, kept: list[tuple[Message, int]], fate: str, g: int) -> list[Prompt]:
    """Append each kept sample's fate (with its staleness) and ack id to step g's ledger; returns the prompts
    among them that carry a ground truth (the newest trained prompts of `val/recent_train_…`)."""
    prompts: list[Prompt] = []
    for m, st in kept:
        ev: Any = m.event
        ledger.fates.append(Fate(ev.sample_id, m.id, fate, st, ev.param_version, g))
        ledger.ack_ids.append(m.ref)
        truth = ev.full_batch.non_tensors.get("ground_truth")
        if truth is not None and "raw_prompt" in ev.full_batch.non_tensors:
            text = str(ev.full_batch.non_tensors["raw_prompt"][0])
            prompts.append(Prompt(uid=ev.sample_id, text=text, answer=str(truth[0])))
    return prompts


def local_update_event(
    g: int, local: int, rank: int, sample_count: int, metrics: dict[str, float],
    fg_counts: dict[str, dict[str, float]],
) -> StepMetrics:
    """Local update `local` of step g on this rank: its `local_update` event with the metrics
    metrics.local_update_metrics put together; non-finite values are left out and counted (rl/metrics.py
    finite_metrics)."""
    return StepMetrics(type="local_update", global_step=g, local_step=local, sample_count=sample_count,
                       rank=rank, metrics=finite_metrics(metrics), counts=fg_counts)  # fmt: skip


def gather_reports(dp: DataParallel, ledger: StepLedger, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's end-of-step report (`mine` with its ledger and, with several ranks, its RNG state for
    the checkpoint's `ranks`), in rank order."""
    rng = dp.roles.if_several(rng_plain)  # a world of one: checkpoint_writer saves its own RNG
    reports = dp.all_gather_plain({**mine, "ledger": ledger.to_plain(), "rng": rng})
    for rep in reports:
        rep["ledger"] = StepLedger.from_plain(rep["ledger"])
    return reports


def fate_counts(ledger: StepLedger) -> tuple[int, int, int, int]:
    """(trained, dropped, evicted, skipped) samples of a step's ledger."""
    trained = sum(1 for f in ledger.fates if f.fate == TRAINED)
    dropped = sum(1 for f in ledger.fates if f.fate == DROPPED)
    skipped = sum(1 for f in ledger.fates if f.fate == SKIPPED)
    return trained, dropped, len(ledger.fates) - trained - dropped - skipped, skipped


def step_end_event(
    g: int, K: int, W: int, merged: StepLedger, reports: list[dict[str, Any]], max_response_length: int
) -> StepMetrics:
    """Step g's `step_end` event over every rank's fates; with several ranks the run's counters are every
    rank's together (each local update has its own)."""
    trained, dropped, evicted, skipped = fate_counts(merged)
    lengths = LengthBuckets.merged(max_response_length, [rep["lengths"] for rep in reports])
    step_end = StepMetrics(
        type="step_end",
        global_step=g,
        local_step=K,
        sample_count=trained,
        num_local_updates=K,
        world_size=W,
        metrics={
            "training/global_step": float(g),
            "trainer/param_version": float(g),
            "trainer/world_size": float(W),
            "fully_async/count/trained_samples": float(trained),
            "fully_async/count/dropped_samples": float(dropped),
            "fully_async/count/evicted_samples": float(evicted),
            "fully_async/count/skipped_samples": float(skipped),
            "fully_async/count/dead_samples": float(sum(rep["dead"] for rep in reports)),
            **lengths.share_metrics(),
        },
    )
    if W > 1:
        for name, total in counter_totals(reports).items():
            step_end.metrics[f"fully_async/count/{name}"] = float(total)
    return step_end


def counter_totals(reports: list[dict[str, Any]]) -> dict[str, int]:
    """The run's counters: every rank's together."""
    return {name: sum(rep["counters"][name] for rep in reports) for name in reports[0]["counters"]}


def checkpoint_meta(
    g: int, pending: list[StepLedger], reports: list[dict[str, Any]], pending_ids: list[list[str]]
) -> dict[str, Any]:
    """The checkpoint metadata of version g: the ledgers it covers and the run's counters; with several
    ranks also each rank's RNG, counters and the sample ids it consumed since the last checkpoint."""
    meta: dict[str, Any] = {"param_version": g, "steps": [lg.to_plain() for lg in pending]}
    meta["counters"] = counter_totals(reports)
    if len(reports) > 1:
        meta["ranks"] = [
            {"rank": r, "rng": rep["rng"], "counters": rep["counters"], "sample_ids": pending_ids[r]}
            for r, rep in enumerate(reports)
        ]
    return meta


@dataclass
class StepEnd:
    """What the end of global step g gathered: the merged ledger (with its step_end), every rank's report,
    whether a checkpoint is due, the whole weights (fsdp; None: the module's own) and version g's probe."""

    g: int
    merged: StepLedger
    reports: list[dict[str, Any]]
    due: bool
    whole: dict[str, Any] | None
    probe: Probe


def timed(fn: Callable[[], Any]) -> float:
    """Run fn (a checkpoint's write); the seconds it took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
