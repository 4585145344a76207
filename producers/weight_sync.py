"""The producer's weights: which param version is loaded, and loading newer ones from `params`.

Every load is checked (the swap check, rollstream/weights/fingerprint.py): when the ParamVersion carries the
trainer's probe, the engine's own log-probs of the probe are computed right after the load and compared. Over
the bound the load is redone once from the version's blob; a second failure raises SwapCheckError and the
producer exits for its supervisor to start a fresh engine. The version is registered (and stamped on samples)
only after the check passed, so a producer never stamps a version its engine does not hold."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial

import redis

from producers.engines import EngineError
from rollstream.keys import Keys
from rollstream.model import BasePolicy
from rollstream.weights.fingerprint import SwapCheckError, probe_diff
from rollstream.weights.store import (
    WeightsError,
    latest_param_version,
    load_weights_into,
    register_producer_version,
    wait_for_param_version,
)
from schemas import ParamVersion

log = logging.getLogger(__name__)

#: Called as on_switch(old_version, new_version) after newer weights were loaded (not for the first load).
SwitchHook = Callable[[int, int], None]

#: Loads a published version into the generating engine (default: `load_weights_into` the policy module).
Loader = Callable[[redis.Redis, ParamVersion], None]

#: The engine's log-probs of a probe sequence (ids -> one log-prob per token after the first), temperature 1.
Prober = Callable[[list[int]], list[float]]


class SwapFailed(SwapCheckError, EngineError):
    """The engine failed the swap check twice for one version: it holds weights of no published version."""


class WeightSync:
    """Loads published weights (sha256 verified) into a policy, or through `loader` into an engine; a
    `VersionSource` for the agent loops. `last_load_s` is the duration of the newest load (the swap time)."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        policy: BasePolicy | None,
        producer: str,
        on_switch: SwitchHook | None = None,
        loader: Loader | None = None,
        prober: Prober | None = None,
        max_diff: float = 1e-3,
    ) -> None:
        if loader is None and policy is None:
            raise ValueError("WeightSync needs a policy or a loader")
        if prober is None and loader is None and hasattr(policy, "module"):  # the built-in engine's module
            from rollstream.weights.fingerprint import policy_probe_logprobs

            assert policy is not None
            prober = partial(policy_probe_logprobs, policy)
        self.prober = prober
        self.max_diff = max_diff
        #: the newest swap check: (version, mean |diff| per probe token, max |diff|); None before any
        self.last_check: tuple[int, float, float] | None = None
        self.r = r
        self.keys = keys
        self.policy = policy
        self.producer = producer
        self.on_switch = on_switch
        self.loader: Loader = loader or self._into_policy
        self.version = -1  # nothing loaded yet
        self.loads = 0
        self.last_load_s = 0.0

    def _into_policy(self, r: redis.Redis, pv: ParamVersion) -> None:
        assert self.policy is not None
        load_weights_into(r, pv, self.policy)  # a large file: hashed, then read a tensor at a time

    def load(self, pv: ParamVersion) -> None:
        """Fetch, verify and load `pv`; register it as this producer's version."""
        t0 = time.perf_counter()
        self.loader(self.r, pv)
        self._check(pv)
        self.last_load_s = time.perf_counter() - t0
        old, self.version = self.version, pv.version
        self.loads += 1
        register_producer_version(self.r, self.keys, self.producer, pv.version)
        log.info("loaded param_version %d (%d bytes) in %.3f s", pv.version, pv.bytes, self.last_load_s)
        if old >= 0 and self.on_switch is not None:
            self.on_switch(old, pv.version)

    def _check(self, pv: ParamVersion) -> None:
        """The swap check of a just-loaded version (module docstring); SwapFailed when the engine fails it
        twice. A version without a probe, or a sync without a prober, is not checked."""
        if self.prober is None or not pv.probe_ids:
            return
        for attempt in (1, 2):
            mean, worst = probe_diff(pv.probe_logprobs, self.prober(list(pv.probe_ids)))
            self.last_check = (pv.version, mean, worst)
            if mean <= self.max_diff:
                return
            log.error(
                "swap check of param_version %d failed (attempt %d): mean |log-prob diff| %.3g per probe "
                "token (max %.3g) > rollout.swap_check_max_diff=%g",
                pv.version, attempt, mean, worst, self.max_diff,
            )
            if attempt == 1:
                self.loader(self.r, pv)  # load it again from the version's blob
        raise SwapFailed(
            f"param_version {pv.version}: the engine's probe log-probs differ from the trainer's by "
            f"{mean:.3g} per token (> rollout.swap_check_max_diff={self.max_diff:g}) after two loads: "
            "exiting for a fresh engine"
        )

    def wait_initial(self, stop: threading.Event, timeout_s: float | None = None) -> bool:
        """Block until a version exists (the trainer publishes 0 at start), then load the newest unless
        loaded (as `refresh`: a blob collected under it is passed over for the newer version); False on
        stop/timeout."""
        pv = wait_for_param_version(self.r, self.keys, newer_than=-1, timeout_s=timeout_s, stop=stop)
        if pv is None:
            return False
        self._load_newest(pv)
        return True

    def refresh(self) -> bool:
        """Load the newest version when newer than the loaded one (one XREVRANGE); True when it did."""
        pv = latest_param_version(self.r, self.keys)
        return pv is not None and self._load_newest(pv)

    def _load_newest(self, pv: ParamVersion) -> bool:
        """Load `pv` when newer than the loaded version; True when it did. A blob garbage-collected between
        reading `params` and the load means a newer version exists: that one is loaded instead. A blob
        that fails with no newer version raises on the first load and is logged and skipped after it (the
        producer keeps generating with the version it holds; the next check tries again)."""
        while pv.version > self.version:
            try:
                self.load(pv)
                return True
            except WeightsError as e:
                newer = latest_param_version(self.r, self.keys)
                if newer is not None and newer.version > pv.version:
                    log.info("param_version %d was collected while loading (%s): loading %d",
                             pv.version, e, newer.version)
                    pv = newer
                    continue
                if self.version < 0:
                    raise
                log.warning("could not load param_version %d, keeping %d: %s", pv.version, self.version, e)
                return False
        return False
