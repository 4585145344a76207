"""The warden: the one identity of a run that manages users, and it serves no data.

No data role may run ACL SETUSER or CLIENT KILL (ACLs cannot bind either to one user, so whoever may run
them can give itself every right). The trainer decides that a producer floods Redis
(rollstream/pacing/fence.py) and asks by writing the producer's name and why to the `fenced` hash; the warden,
a program of its own under supervisord logged in as the `warden` user, reads that hash every `period_s` and,
for each of the run's producers in it, switches that producer's user off and kills its connections. It does
so again at every pass (both are idempotent), so a Redis restart, which reloads the users from the ACL file,
or a fenced producer that reconnected in between, stays fenced. A name in the hash that is not one of the
run's producers (the trainer's credential can write anything there) is logged and left alone: the trainer
can ask for a producer to be fenced, never for anything else.

The warden's user may read `fenced` and write nothing but the users and connections it manages: no stream,
no weights, no pacing key (rollstream/ops/acl.py).

`python -m rollstream.ops.warden CONF [key=value ...]`: the program `rollstream run` starts when the run has
ACL users (rollstream/ops/plan.py).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import redis

from rollstream.bus.connection import CONNECTION_ERRORS
from rollstream.bus.ids import text
from rollstream.keys import Keys

log = logging.getLogger(__name__)

#: Seconds between two passes of the warden (a fence request waits at most about this).
WARDEN_PERIOD_S = 0.5


class Warden:
    """Applies the trainer's fence requests (`fenced`: producer -> why) to the run's producers' users."""

    def __init__(self, keys: Keys, producers: Sequence[str]) -> None:
        """Act on `producers` (the run's producer names) only."""
        self.keys, self.producers = keys, set(producers)
        self.applied: dict[str, str] = {}  # producer -> why, fenced by this process
        self._refused: set[str] = set()  # names asked for that are not the run's producers (logged once)

    def run_once(self, r: redis.Redis) -> list[str]:
        """Fence every producer the `fenced` hash names (again: idempotent); returns those fenced for the
        first time by this process."""
        raw: Any = r.hgetall(self.keys.fenced)
        new = []
        for name, why in raw.items():
            producer, reason = text(name), text(why)
            if producer not in self.producers:
                if producer not in self._refused:
                    self._refused.add(producer)
                    log.error("fence request for %r ignored: not one of the run's producers", producer)
                continue
            killed, failed = self.fence(r, producer)
            if producer not in self.applied:
                self.applied[producer] = reason
                new.append(producer)
                log.error("FENCED producer %s (asked by the trainer: %s): user switched off, %d connections "
                          "killed%s", producer, reason, killed, f" (could not: {failed})" if failed else "")
        return new

    def fence(self, r: redis.Redis, producer: str) -> tuple[int, str]:
        """Switch `producer`'s user off and kill its connections: (connections killed, what failed or '')."""
        failed = []
        killed = 0
        try:
            r.execute_command("ACL", "SETUSER", producer, "off")
        except redis.ResponseError as e:  # no such user (run.acl off)
            failed.append(f"ACL SETUSER: {e}")
        try:
            killed = int(r.execute_command("CLIENT", "KILL", "USER", producer))
        except redis.ResponseError as e:
            failed.append(f"CLIENT KILL: {e}")
        return killed, "; ".join(failed)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the warden until SIGTERM: one pass every WARDEN_PERIOD_S, connection errors waited out."""
    from rollstream.keys import producer_names
    from rollstream.runtime.process import EXIT_OK, start_worker

    ctx, _ = start_worker("rollstream.ops.warden", argv)
    warden = Warden(ctx.keys, producer_names(ctx.cfg.rollout.num_producers))
    log.info("warden of run %s: fencing on request, producers %s", ctx.cfg.run.name, sorted(warden.producers))
    while not ctx.stop.wait(WARDEN_PERIOD_S):
        try:
            warden.run_once(ctx.r)
        except CONNECTION_ERRORS as e:
            log.warning("warden: %s; retrying", e)
            ctx.stop.wait(1.0)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
