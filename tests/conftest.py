"""Shared fixtures: a real Redis (never a mock), one key namespace per test, cleaned up afterwards."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import redis

from consumers.trainer.leaser import Leaser
from rollstream.bus import delete_run
from rollstream.keys import Keys, producer_names

if TYPE_CHECKING:
    import torch

    from schemas import RolloutSample

REDIS_URL = os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def redis_url() -> str:
    """URL of the test Redis."""
    return REDIS_URL


@pytest.fixture
def r() -> Iterator[redis.Redis]:
    """A bytes client on the test Redis."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=10)
    try:
        client.ping()
    except redis.ConnectionError as e:
        pytest.fail(f"tests need a real Redis at {REDIS_URL} (run scripts/setup.sh): {e}")
    yield client
    client.close()


@pytest.fixture
def keys(r: redis.Redis) -> Iterator[Keys]:
    """A fresh run namespace for this test; all its keys are deleted afterwards."""
    k = Keys(f"t-{uuid.uuid4().hex[:12]}")
    yield k
    delete_run(r, k)


def padded_arrays(batch: Any) -> dict[str, Any]:
    """Every row of an assembled mini-batch padded as the learner pads the rows it trains
    (consumers/trainer/batch.py `MiniBatch.padded`), as numpy arrays (views) under verl's names: schema 1's
    padded layout, whose `prompts` and `responses` are the id columns either side of P."""
    import torch

    p = batch.padded(None, torch.device("cpu"))
    P = p.ids.shape[1] - p.width
    out = {"input_ids": p.ids.numpy(), "attention_mask": p.mask.numpy(), "prompts": p.ids[:, :P].numpy(),
           "responses": p.ids[:, P:].numpy(), "response_mask": p.resp_mask.numpy(),
           "rollout_log_probs": p.behave.numpy(), "rewards": batch.rewards.numpy()}
    if p.scores is not None:
        out["token_level_scores"] = p.scores.numpy()
    return out


#: The producers of a test run (a default config's two) and the one whose streams a test writes by default.
PRODUCERS = producer_names(2)
P0 = PRODUCERS[0]


@pytest.fixture
def leasing(r: redis.Redis, keys: Keys) -> Iterator[Leaser]:
    """The trainer's lease loop for rollout_00 … rollout_03 of this test's run (tests that play the trainer
    with grant_budget and run real producers); stopped afterwards."""
    leaser = Leaser(r, keys, producer_names(4), threading.Event()).start()
    yield leaser
    leaser.stop.set()
    assert leaser.thread is not None
    leaser.thread.join(timeout=5)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread for the test: on a shared box a tiny model's many small ops otherwise wait on each
    other's threads (100x slower at load 12 on 2 cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def one_version_rows(
    samples: Iterable[RolloutSample],
) -> Iterator[tuple[int, list[int], list[int], torch.Tensor]]:
    """Each non-empty row of these samples that one version generated: (that version, its prompt ids, its
    response ids, its behaviour log-probs [R] float32)."""
    import torch

    for s in samples:
        b = s.full_batch
        po, ro, plen = b.prompt_offsets(), b.response_offsets(), b.row_prompt_lens()
        for i in range(len(b)):
            if s.param_version_start[i] != s.param_version_end[i] or ro[i] == ro[i + 1]:
                continue
            prompt = [int(t) for t in b.prompt_ids[po[i] : po[i] + plen[i]]]
            response = [int(t) for t in b.response_ids[ro[i] : ro[i + 1]]]
            got = torch.from_numpy(b.tokens["rollout_log_probs"][ro[i] : ro[i + 1]].astype("float32"))
            yield s.param_version_start[i], prompt, response, got


def publish_during_steps(engine: Any, at_step: int, publish: Callable[[], Any]) -> list[int]:
    """Wrap a continuous engine's `step` (until `del engine.step`): each step first notes the rows in flight
    (the list returned), and the `at_step`-th calls `publish` (the trainer publishing a version mid-run)."""
    step, occupancy = engine.step, []

    def stepping() -> Any:
        occupancy.append(engine.in_flight)
        if len(occupancy) == at_step:
            publish()
        return step()

    engine.step = stepping
    return occupancy
