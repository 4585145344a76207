"""Checks of a short live run (end-to-end tests, scripts/gpu_check.py): wait until the trainer has
finished N global steps and every producer generates with version N; throughput read back from the log;
and the behaviour log-probs producers stored against a fresh recompute by the trainer's code.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from rollstream.bus import iter_stream, parse_id, run_producers
from rollstream.config import PipelineConfig
from rollstream.keys import Keys
from rollstream.ops.plan import SuperviseError
from rollstream.ops.run_target import RunTarget
from rollstream.ops.supervise import failed_programs
from rollstream.weights.fingerprint import SWAP_CHECK_DIFF, SWAP_CHECK_VERSION
from rollstream.weights.store import latest_param_version, producer_versions
from schemas import DecodeError, ProducerStats, RolloutSample, StepMetrics, decode


def _last_record_step(r: redis.Redis, keys: Keys) -> int:
    """Global step of the newest record (-1 when there is none)."""
    rows: Any = r.xrevrange(keys.records, count=1)
    if not rows:
        return -1
    return parse_id(rows[0][0])[0]


def wait_for_steps(target: RunTarget, steps: int, timeout_s: float, poll_s: float = 0.3) -> None:
    """Block until version `steps` is published, its record is written and every producer reports it;
    SuperviseError when a program failed or on timeout (naming what was missing)."""
    cfg, keys = target.cfg, target.keys
    deadline = time.monotonic() + timeout_s
    r = target.connect()
    try:
        while True:
            pv = latest_param_version(r, keys)
            published = pv.version if pv is not None else -1
            record = _last_record_step(r, keys)
            versions = producer_versions(r, keys)
            behind = {p: v for p, v in versions.items() if v < steps}
            if (
                published >= steps
                and record >= steps
                and len(versions) == cfg.rollout.num_producers
                and not behind
            ):
                return
            failed = failed_programs(target.run_dir)
            if failed:
                raise SuperviseError(f"{'; '.join(failed)} (see {target.run_dir / 'logs'})")
            if time.monotonic() > deadline:
                raise SuperviseError(
                    f"after {timeout_s:.0f}s: published version {published}, last record {record}, "
                    f"producer versions {versions} (want {steps} everywhere)"
                )
            time.sleep(poll_s)
    finally:
        r.close()


@dataclass
class Throughput:
    """End-to-end rates over global steps 2..N (from step 1's end to step N's end)."""

    window_s: float
    samples: int  # samples (prompts) trained in the window
    tokens: float  # prompt + response tokens trained in the window (verl's perf/total_num_tokens)
    gen_tokens_per_s: float  # producers' own decode rate (mean of their ProducerStats over the run)

    @property
    def samples_per_s(self) -> float:
        """Trained samples per second, end to end."""
        return self.samples / self.window_s if self.window_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Trained tokens per second, end to end."""
        return self.tokens / self.window_s if self.window_s > 0 else 0.0


def _events(r: redis.Redis, *streams: str) -> Iterator[Any]:
    """Every decodable event of the streams, one stream after the other, each in order (undecodable entries
    are skipped)."""
    for stream in streams:
        for _, fields in iter_stream(r, stream):
            try:
                yield decode(fields)
            except DecodeError:
                continue


def producer_stats(r: redis.Redis, keys: Keys) -> Iterator[ProducerStats]:
    """Every ProducerStats event of the run's producers' `stats:<p>` streams, each producer's in order."""
    for ev in _events(r, *keys.stats_streams(run_producers(r, keys))):
        if isinstance(ev, ProducerStats):
            yield ev


def swap_checks(r: redis.Redis, keys: Keys) -> dict[tuple[str, int], float]:
    """(producer, version) -> the swap check's mean |log-prob diff| per probe token
    (rollstream/weights/fingerprint.py) for every version a producer's stats report checked."""
    out: dict[tuple[str, int], float] = {}
    for ev in producer_stats(r, keys):
        if SWAP_CHECK_VERSION in ev.metrics and SWAP_CHECK_DIFF in ev.metrics:
            out[(ev.producer, int(ev.metrics[SWAP_CHECK_VERSION]))] = float(ev.metrics[SWAP_CHECK_DIFF])
    return out


def throughput(r: redis.Redis, keys: Keys) -> Throughput:
    """Rates from the trainer's metrics events and the producers' stats (needs >= 2 finished steps)."""
    ends: dict[int, StepMetrics] = {}
    tokens: dict[int, float] = {}
    for ev in _events(r, keys.metrics):
        if isinstance(ev, StepMetrics) and ev.type == "step_end":
            ends[ev.global_step] = ev
        elif isinstance(ev, StepMetrics):
            tokens[ev.global_step] = tokens.get(ev.global_step, 0.0) + ev.metrics.get(
                "perf/total_num_tokens", 0.0
            )
    gen = [float(st.gen_tokens_per_s) for st in producer_stats(r, keys) if st.gen_tokens_per_s > 0]
    steps = sorted(ends)
    if len(steps) < 2:
        raise ValueError(f"need at least 2 finished global steps for a rate, have {steps}")
    first, last = steps[0], steps[-1]
    window = [g for g in steps if g > first]
    return Throughput(
        window_s=ends[last].created_at - ends[first].created_at,
        samples=sum(ends[g].sample_count for g in window),
        tokens=sum(tokens.get(g, 0.0) for g in window),
        gen_tokens_per_s=sum(gen) / len(gen) if gen else 0.0,
    )


def behaviour_logprob_error(
    r: redis.Redis, keys: Keys, cfg: PipelineConfig, version: int = 0, max_samples: int = 32
) -> tuple[float, int]:
    """Largest |stored behaviour log-prob - the trainer's recompute| over the generated tokens of samples
    made wholly under `version` (whose weights the policy built from `cfg` holds: version 0 = the initial
    weights), at rollout.temperature with the trainer's logprob chunking; returns (error, tokens compared)."""
    import torch

    from rollstream.model import build_policy

    policy = build_policy(cfg)
    policy.logprob_chunk_size = cfg.actor.logprob_chunk_size
    worst, count, seen = 0.0, 0, 0
    for ev in _events(r, *keys.rollouts_streams(run_producers(r, keys))):
        if not isinstance(ev, RolloutSample) or ev.param_version != version:
            continue
        if set(ev.param_version_start) | set(ev.param_version_end) != {version}:
            continue
        b = ev.full_batch  # one row at a time: nothing to pad
        po, ro, plen = b.prompt_offsets(), b.response_offsets(), b.row_prompt_lens()
        mask = b.tokens.get("response_mask")
        for i in range(len(b)):
            resp = b.response_ids[ro[i] : ro[i + 1]]
            if not resp.size:
                continue
            ids = torch.tensor(
                np.concatenate([b.prompt_ids[po[i] : po[i] + plen[i]], resp]).astype(np.int64)
            )[None]
            with torch.no_grad():
                fresh = policy.log_probs(ids, torch.ones_like(ids), resp.size, cfg.rollout.temperature).cpu()[
                    0
                ]
            behave = torch.from_numpy(b.tokens["rollout_log_probs"][ro[i] : ro[i + 1]].astype(np.float32))
            keep = (
                torch.ones(resp.size, dtype=torch.bool)
                if mask is None
                else torch.from_numpy(mask[ro[i] : ro[i + 1]] != 0)
            )
            diff = (fresh - behave).abs()[keep]
            if diff.numel():
                worst = max(worst, float(diff.max()))
                count += int(diff.numel())
        seen += 1
        if seen >= max_samples:
            break
    return worst, count
