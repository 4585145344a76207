"""What WAIT costs a publish: a producer's publish transaction (XADD of a fake rollout of the given size, its
published count and cursor, one MULTI) through Sentinel, acknowledged by 0, 1 or 2 replicas.

Run: `rollstream bench replication [--samples N] [--response-len L] [--publishes P]`. For each replica
count R in 0, 1, 2 it starts a private topology (a primary, R replicas and, with R > 0, 3 Sentinels, AOF
fsync always as `rollstream run` runs them; for R = 0 the primary alone, no Sentinel) in a temp folder,
publishes P times with WAIT R (none for 0), and prints publishes/s and the median and p99 latency of one
publish. Everything runs on this host: the replicas' round trip is loopback, so a network adds its RTT on
top of the WAIT column.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rollstream.bus import connect
from rollstream.keys import Keys
from rollstream.ops.acl import generate_passwords
from rollstream.ops.embedded_redis import EmbeddedRedis
from rollstream.testing.fakes import fake_rollout_sample
from rollstream.topology.replicated import (
    REPLICATION_USER,
    SENTINEL_USER,
    SENTINELS_USER,
    EmbeddedTopology,
    plan_topology,
)
from rollstream.topology.replication import execute_replicated
from schemas import encode


def publish_loop(
    url: str, replicas: int, payload: dict[bytes, bytes], publishes: int, sentinel_password: str | None = None
) -> list[float]:
    """Publish `publishes` times (XADD + INCRBY + SET in one MULTI, then WAIT `replicas`); seconds each."""
    r = connect(url, wait_replicas=replicas, wait_timeout_ms=5000, sentinel_password=sentinel_password)
    keys = Keys("bench-repl")
    stream = keys.rollouts_of("rollout_00")
    times = []
    for i in range(publishes):
        t0 = time.perf_counter()
        pipe = r.pipeline(transaction=True)
        pipe.xadd(stream, payload)  # type: ignore[arg-type]
        pipe.incrby(keys.producer_published("rollout_00"), 1)
        pipe.set(keys.producer_cursor("rollout_00"), str(i))
        execute_replicated(pipe, "publish")
        times.append(time.perf_counter() - t0)
    r.close()
    return times


def measure(replicas: int, payload: dict[bytes, bytes], publishes: int) -> list[float]:
    """Start the topology for `replicas` in a temp folder, run the publish loop, stop it."""
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-repl-") as tmp:
        run_dir = Path(tmp)
        if replicas == 0:
            single = EmbeddedRedis(run_dir)
            single.argv += ["--appendfsync", "always"]  # the last one wins: as `rollstream run` runs it
            single.start()
            try:
                return publish_loop(single.url, 0, payload, publishes)
            finally:
                single.stop()
        secrets = run_dir / "secrets"
        files = generate_passwords(secrets, [REPLICATION_USER, SENTINEL_USER, SENTINELS_USER])
        pw = {u: p.read_text().strip() for u, p in files.items()}
        topo = plan_topology(run_dir, replicas, "bench", secrets, acl_file=None, passwords=pw,
                             appendfsync="always")
        emb = EmbeddedTopology(topo, run_dir)
        emb.start()
        try:
            deadline = time.monotonic() + 30
            while True:  # every replica attached before measuring
                try:
                    return publish_loop(topo.url, replicas, payload, publishes, pw[SENTINELS_USER])
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        finally:
            emb.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Measure publishes with 0, 1 and 2 replicas and print one line each."""
    p = argparse.ArgumentParser(prog="rollstream bench replication", description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=8, help="trajectories in the fake rollout (n)")
    p.add_argument("--response-len", type=int, default=256, help="response tokens per trajectory")
    p.add_argument("--publishes", type=int, default=300, help="publishes per replica count")
    args = p.parse_args(argv)
    sample = fake_rollout_sample("rollout_00-0", n=args.samples, response_len=args.response_len)
    payload = {k.encode(): bytes(v) for k, v in encode(sample).items()}
    size = sum(len(k) + len(v) for k, v in payload.items())
    print(f"publish = one MULTI: XADD of a {size} byte rollout, INCRBY, SET; {args.publishes} each; loopback")
    for replicas in (0, 1, 2):
        times = measure(replicas, payload, args.publishes)
        times.sort()
        med, p99 = statistics.median(times) * 1e3, times[int(0.99 * (len(times) - 1))] * 1e3
        label = "no WAIT" if replicas == 0 else f"WAIT {replicas}"
        print(f"{replicas} replicas ({label}): {len(times) / sum(times):.0f} publishes/s, "
              f"median {med:.2f} ms, p99 {p99:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
