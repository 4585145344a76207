"""Synthetic events for tests, benchmarks and load tests (no model): RolloutSamples of a chosen size,
packed as a producer packs a group (`RaggedBatch.from_rows`, the packing producers/rollout.py uses;
tests/test_ragged.py checks that a fake encodes to the same bytes as the producers' builder makes of its
rows), and a metrics log shaped like the trainer's and producers'."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis

from rollstream.bus import Publisher, parse_id, run_producers, setup_run
from rollstream.keys import COMMITTED_STEP_FIELD, TRAINING_STEP_FIELD, Keys
from rollstream.model import CharTokenizer
from rollstream.pacing.budget import lease_outright, leased_sample_id
from schemas import EventBase, ProducerStats, RolloutSample, StepMetrics, ValidateMetrics
from schemas.batch import object_array
from schemas.ragged import RaggedBatch


class FakeTokenizer(CharTokenizer):
    """Token ids without text: the CharTokenizer's pad=0, bos=1, eos=2, but `vocab` ids and every id
    decodes to "" (fake samples carry random ids, so their raw_prompt and response_text are empty)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return self.vocab

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """No text has ids: [bos] or []."""
        return [self.bos_id] if add_bos else []

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Ids have no text: always ""."""
        return ""


def fake_rollout_sample(
    sample_id: str,
    *,
    param_version: int = 0,
    n: int = 4,
    prompt_len: int = 8,
    response_len: int = 16,
    epoch: int = 0,
    producer: str = "fake",
    seed: int = 0,
    rewards: list[float] | None = None,
    ragged: bool = False,
    vocab: int = 30,
) -> RolloutSample:
    """A valid RolloutSample with random tokens and finite log-probs, as producers.rollout's
    build_rollout_sample packs a producer's group (every token generated, every row finished in one turn,
    empty texts); size grows with n * response_len. The group's rows share one prompt; ragged=True gives each
    response a random length in [1, response_len]; token ids are in [3, vocab); rewards are in [0, 1]."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, vocab, size=prompt_len, dtype=np.int64).tolist()
    responses = rng.integers(3, vocab, size=(n, response_len), dtype=np.int64)
    lengths = (
        rng.integers(1, response_len + 1, size=n) if ragged and response_len else np.full(n, response_len)
    )
    logp = -rng.random((n, response_len), dtype=np.float32)
    scores = rewards if rewards is not None else rng.random(n).tolist()
    rows = [responses[i, :length].tolist() for i, length in enumerate(int(x) for x in lengths)]
    batch = RaggedBatch.from_rows(
        [prompt] * n, rows, [[1] * len(row) for row in rows],
        [logp[i, : len(row)].tolist() for i, row in enumerate(rows)], vocab,
    )
    batch.rows["rewards"] = np.asarray(scores, dtype=np.float32)
    batch.non_tensors.update({
        "uid": object_array([sample_id] * n), "raw_prompt": object_array([""] * n),
        "response_text": object_array([""] * n),
    })
    batch.check()
    return RolloutSample(
        sample_id=sample_id,
        epoch=epoch,
        param_version=param_version,
        full_batch=batch,
        agent_loop_output_list=[
            {"num_turns": 1, "response_length": len(row), "reward": float(score), "exact": False,
             "finished": True}
            for row, score in zip(rows, scores, strict=True)
        ],
        processing_times=[0.01] * n,
        tool_calls=[],
        param_version_start=[param_version] * n,
        param_version_end=[param_version] * n,
        rollout_status={"dispatched": 1},
        producer=producer,
    )


def leased_fakes(
    r: redis.Redis, keys: Keys, count: int, producer: str = "rollout_00", **kwargs: Any
) -> list[RolloutSample]:
    """`count` fake samples of `producer` that its lease covers: the prompts are leased outright (as the
    trainer would lease them) and the samples get their ids `<producer>-<seq>`; `kwargs` go to
    fake_rollout_sample (`seed` defaults to the seq)."""
    end = lease_outright(r, keys, producer, count)
    return [
        fake_rollout_sample(
            leased_sample_id(producer, seq), producer=producer, **{"seed": seq, **kwargs}
        )
        for seq in range(end - count, end)
    ]


def response_len_for_bytes(target_bytes: int, n: int = 4) -> int:
    """Response length that makes a fake sample about target_bytes on the wire: per response token and row,
    schema 4 sends an id (uint8 in the fakes' small vocabulary, int32 in a real one's) and a float32
    log-prob; sized as 8 bytes so a sample's size matches a real vocabulary's."""
    return max(1, target_bytes // (n * 8))


# -- the metrics log --------------------------------------------------------------------------------


def local_update(g: int, k: int, sample_count: int, metrics: dict[str, float]) -> StepMetrics:
    """A `local_update` event of global step g, local step k."""
    return StepMetrics(
        type="local_update", global_step=g, local_step=k, sample_count=sample_count, metrics=metrics
    )


def step_end(
    g: int, k: int, metrics: dict[str, float] | None = None, created_at: float = 100.0
) -> StepMetrics:
    """The `step_end` event of global step g after k local updates."""
    return StepMetrics(
        type="step_end",
        global_step=g,
        local_step=k,
        sample_count=0,
        num_local_updates=k,
        metrics=metrics or {},
        created_at=created_at,
    )


def producer_stats(
    name: str, samples: int, gen_tokens_per_s: float, idle_ratio: float, pv: int
) -> ProducerStats:
    """A ProducerStats event (tokens = 10 per sample)."""
    return ProducerStats(
        producer=name,
        param_version=pv,
        samples=samples,
        tokens=samples * 10,
        gen_tokens_per_s=gen_tokens_per_s,
        idle_ratio=idle_ratio,
    )


def validation(version: int, metrics: dict[str, float]) -> ValidateMetrics:
    """A ValidateMetrics event of a param version."""
    return ValidateMetrics(param_version=version, global_step=version, metrics=metrics)


# Metric names covering every aggregation rule.
BASE_METRICS = (
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "timing_s/update",
    "response_length/max",
    "response_length/min",
    "critic/score/mean",
    "training/off_policy/dropped_samples",
    "fully_async/partial/total_partial_num",
)


def fake_metrics_log(
    num_steps: int,
    *,
    local_updates: int = 2,
    producers: int = 2,
    metrics_per_update: int = 10,
    test_freq: int = 5,
    first_step: int = 1,
    seed: int = 0,
) -> list[EventBase]:
    """Events of `num_steps` global steps in the order a run emits them: producer stats, local updates,
    a validation every `test_freq` versions, then the step_end."""
    rng = random.Random(seed)
    names = list(BASE_METRICS) + [
        f"extra/m{i}" for i in range(max(0, metrics_per_update - len(BASE_METRICS)))
    ]
    names = names[:metrics_per_update]
    events: list[EventBase] = []
    clock = 1_700_000_000.0
    for g in range(first_step, first_step + num_steps):
        for p in range(producers):
            clock += 0.1
            events.append(
                ProducerStats(
                    producer=f"rollout_{p:02d}",
                    param_version=g - 1,
                    samples=g * 8 + p,
                    tokens=g * 100 + p,
                    gen_tokens_per_s=round(rng.uniform(50, 150), 3),
                    idle_ratio=round(rng.random(), 3),
                    created_at=clock,
                )
            )
        for k in range(1, local_updates + 1):
            clock += 0.5
            metrics = {name: round(rng.uniform(0, 10), 4) for name in names}
            events.append(
                StepMetrics(
                    type="local_update",
                    global_step=g,
                    local_step=k,
                    sample_count=rng.randint(4, 8),
                    metrics=metrics,
                    created_at=clock,
                )
            )
        if test_freq and g % test_freq == 0:
            clock += 0.1
            events.append(
                ValidateMetrics(
                    param_version=g, global_step=g, metrics={"val/acc": rng.random()}, created_at=clock
                )
            )
        clock += 0.1
        events.append(
            StepMetrics(
                type="step_end",
                global_step=g,
                local_step=local_updates,
                sample_count=0,
                num_local_updates=local_updates,
                metrics={"timing_s/step": 1.0 + rng.random(), "timing_s/gen": rng.random()},
                created_at=clock,
            )
        )
    return events


def publish_log(r: redis.Redis, keys: Keys, events: list[EventBase], trainer_at: int = 10**6) -> list[str]:
    """Set the run up (idempotent; its producers are those the stats events name) and XADD the events in
    order: producer stats to their producer's `stats:<p>`, the rest to `metrics`, with explicit ids increasing
    across the streams (one log order). The trainer hash says the trainer committed up to `trainer_at`, so
    the aggregator finds the events plausible. Returns the ids."""
    producers = sorted({ev.producer for ev in events if isinstance(ev, ProducerStats)})
    setup_run(r, keys, producers)
    r.hset(keys.trainer, mapping={COMMITTED_STEP_FIELD: trainer_at, TRAINING_STEP_FIELD: trainer_at})
    rc: Any = r
    streams = [keys.metrics, *keys.stats_streams(run_producers(r, keys))]
    last = max((parse_id(i) for s in streams for i, _ in rc.xrevrange(s, count=1)), default=(0, 0))
    sec, usec = rc.time()
    base = max(int(sec) * 1000 + int(usec) // 1000, last[0] + 1)
    pub = Publisher(r)
    return [
        pub.publish(
            keys.stats_of(ev.producer) if isinstance(ev, ProducerStats) else keys.metrics,
            ev,  # type: ignore[arg-type]
            entry_id=f"{base}-{i + 1}",
        )
        for i, ev in enumerate(events)
    ]
