"""End-to-end bus benchmark across source trees: realistic samples (n = 8, one shared 64-token prompt, ragged
responses, a 151,936-id vocabulary) through `Publisher.publish` -> `GroupReader.poll` -> `ack`, producer and
consumer in two processes, each tree's own code, trees alternated in one window.

`rollstream bench bus_e2e --trees . /tmp/old3b --reps 3` runs, for each repetition, size class and tree in
turn, this file as a script with PYTHONPATH=<tree> twice (one producer, one consumer process), so each tree's
rollstream and schemas packages do the work: the sample is built in the tree's own batch form (a ragged
batch where the tree has schemas/ragged.py, else the padded int64 DataProto its producers sent). The
consumer times first to last sample received; the table gives samples/s per tree (median and range over
the repetitions), the ratio to the first tree's median, and each tree's wire bytes per sample. Only
the script mode imports the tree under test; the driver imports nothing of it. `--codec` prints each tree's
CPU µs per encode and decode instead (process time: less moved by other processes' load than wall time).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

N, PROMPT_LEN, VOCAB = 8, 64, 151_936
#: size class -> mean response length (responses drawn in [1, 2 x mean - 1])
SIZES = {"small": 16, "medium": 256, "large": 3072}
#: samples per trial per size class (about 2-3 s of work on a 2-core box)
COUNTS = {"small": 3000, "medium": 600, "large": 60}


def trajectories(mean_len: int, seed: int) -> tuple[list[int], list[list[int]], list[list[float]]]:
    """The shared prompt, n ragged responses and their log-probs (plain lists: no tree involved)."""
    import random

    rng = random.Random(seed)
    prompt = [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]
    responses = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 2 * mean_len))] for _ in range(N)]
    log_probs = [[-rng.random() for _ in r] for r in responses]
    return prompt, responses, log_probs


def build_sample(mean_len: int, seed: int) -> Any:
    """A RolloutSample in the batch form of the tree on sys.path."""
    import numpy as np

    from schemas import DataProto, RolloutSample

    prompt, responses, log_probs = trajectories(mean_len, seed)
    uid = np.array(["e2e"] * N, dtype=object)
    rewards = np.linspace(0, 1, N, dtype=np.float32)
    if importlib.util.find_spec("schemas.ragged") is None:  # before schema 3: the padded int64 batch it sent
        R = max(len(r) for r in responses)
        ids = np.zeros((N, PROMPT_LEN + R), np.int64)
        mask = np.zeros_like(ids)
        lp = np.zeros((N, R), np.float32)
        for i, (resp, lps) in enumerate(zip(responses, log_probs, strict=True)):
            ids[i, :PROMPT_LEN], ids[i, PROMPT_LEN : PROMPT_LEN + len(resp)] = prompt, resp
            mask[i, : PROMPT_LEN + len(resp)] = 1
            lp[i, : len(resp)] = lps
        batch: Any = DataProto(
            {
                "prompts": ids[:, :PROMPT_LEN],
                "responses": ids[:, PROMPT_LEN:],
                "input_ids": ids,
                "attention_mask": mask,
                "response_mask": mask[:, PROMPT_LEN:].copy(),
                "rollout_log_probs": lp,
                "rewards": rewards,
            },
            {"uid": uid},
        )
    else:
        from producers.rollout import Trajectory, ragged_batch

        trajs = [
            Trajectory(prompt, r, [1] * len(r), lps) for r, lps in zip(responses, log_probs, strict=True)
        ]
        batch = ragged_batch(trajs, VOCAB)
        batch.rows["rewards"], batch.non_tensors["uid"] = rewards, uid
    return RolloutSample(
        sample_id="e2e",
        epoch=0,
        param_version=0,
        full_batch=batch,
        agent_loop_output_list=[{"num_turns": 1} for _ in range(N)],
        processing_times=[0.0] * N,
        param_version_start=[0] * N,
        param_version_end=[0] * N,
        producer="e2e",
    )


def _client(url: str) -> Any:
    """The tree's own client (connect()) as its workers get it, allocator tuned where the tree does that."""
    from rollstream.bus import connect

    try:
        from rollstream.runtime.process import tune_allocator
    except ImportError:
        pass
    else:
        tune_allocator()
    return connect(url)


def run_producer(url: str, stream: str, size: str, count: int) -> None:
    """Publish `count` samples one by one."""
    from rollstream.bus import Publisher

    r = _client(url)
    sample = build_sample(SIZES[size], seed=1)
    pub = Publisher(r)
    for _ in range(count):
        pub.publish(stream, sample)


def run_consumer(url: str, stream: str, size: str, count: int, tree: str) -> dict[str, Any]:
    """Create the group, start the producer process, poll and ack until `count` samples arrived; returns
    samples/s from the first sample received to the last, and the wire bytes of one entry."""
    from rollstream.bus import GroupReader, ensure_group
    from schemas import RolloutSample, encode

    r = _client(url)
    group, dead = "trainer", f"{stream}:dead"
    ensure_group(r, stream, group)
    wire = sum(len(k) + memoryview(v).nbytes for k, v in encode(build_sample(SIZES[size], seed=1)).items())
    reader = GroupReader(r, stream, group, "c", dead_stream=dead, count=64)
    env = {**os.environ, "PYTHONPATH": tree}
    producer = subprocess.Popen(
        _role_argv("producer", url, stream, size, count),
        env=env,
    )
    got, first, last = 0, 0.0, 0.0
    try:
        while got < count:
            msgs = reader.poll(block_ms=2000)
            if not msgs:
                if producer.poll() is not None and producer.returncode != 0:
                    raise RuntimeError(f"producer exited {producer.returncode}")
                continue
            now = time.perf_counter()
            first = first or now
            last = now
            reader.ack([m.id for m in msgs])
            got += sum(isinstance(m.event, RolloutSample) for m in msgs)
        producer.wait(60)
    finally:
        if producer.poll() is None:
            producer.kill()
        r.delete(stream, dead)
    return {"samples_per_s": (got - 1) / (last - first) if last > first else 0.0, "wire_bytes": wire}


def _role_argv(role: str, url: str, stream: str, size: str, count: int) -> list[str]:
    """The command line of this script in `role` (producer or consumer) on `stream`."""
    return [sys.executable, __file__, "--role", role, "--url", url, "--stream", stream, "--size", size,
            "--count", str(count)]


def run_codec(sizes: list[str]) -> dict[str, Any]:
    """CPU µs per encode and per decode (of the fields as Redis returns them) of each size's sample in this
    process's tree: time.process_time, best of 5 loops (other processes' load inflates wall time, not
    this)."""
    from schemas import decode, encode

    def per_call_us(fn: Any, calls: int) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            best = min(best, (time.process_time() - t0) / calls * 1e6)
        return best

    out = {}
    for size in sizes:
        sample = build_sample(SIZES[size], seed=1)
        fields = {k.encode(): bytes(v) for k, v in encode(sample).items()}
        calls = max(20, 40_000 // SIZES[size])
        out[size] = {
            "encode_us": per_call_us(partial(encode, sample), calls),
            "decode_us": per_call_us(partial(decode, fields), calls),
        }
    return out


def trial(tree: str, size: str, url: str, count: int) -> dict[str, Any]:
    """One consumer process (which starts its producer) on `tree`: its JSON result."""
    stream = f"rs:{{e2e-{uuid.uuid4().hex[:8]}}}:rollouts"
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [*_role_argv("consumer", url, stream, size, count), "--tree", tree],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{tree} {size}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def codec_table(trees: list[str], sizes: list[str]) -> int:
    """Print CPU µs per encode / decode per size and tree (each tree in its own process)."""
    got = {}
    for tree in trees:
        out = subprocess.run(
            [sys.executable, __file__, "--role", "codec", "--sizes", ",".join(sizes)],
            env={**os.environ, "PYTHONPATH": tree},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
        got[tree] = json.loads(out.stdout.strip().splitlines()[-1])
    print("| size | tree | encode µs (CPU) | decode µs (CPU) |")
    print("|---|---|---:|---:|")
    for size in sizes:
        for tree in trees:
            row = got[tree][size]
            print(f"| {size} | {tree} | {row['encode_us']:,.1f} | {row['decode_us']:,.1f} |")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `rollstream bench bus_e2e` (and of the script's own producer/consumer roles)."""
    p = argparse.ArgumentParser(prog="rollstream bench bus_e2e", description=__doc__.splitlines()[0])
    p.add_argument(
        "--trees", nargs="+", default=["."], help="source trees to compare (the first is the base)"
    )
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated size classes of {list(SIZES)}")
    p.add_argument(
        "--reps", type=int, default=3, help="repetitions; each runs every size on every tree in turn"
    )
    p.add_argument(
        "--scale", type=float, default=1.0, help="multiply every size's sample count (trial length)"
    )
    p.add_argument(
        "--url",
        default=os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="Redis to run against (each trial's stream is deleted afterwards)",
    )
    p.add_argument("--json", action="store_true", help="print every trial as JSON instead of the table")
    p.add_argument(
        "--codec",
        action="store_true",
        help="instead of the bus: CPU µs per encode and decode of each size's sample in each tree",
    )
    p.add_argument(
        "--role",
        choices=["driver", "producer", "consumer", "codec"],
        default="driver",
        help=argparse.SUPPRESS,
    )
    p.add_argument("--stream", default="", help=argparse.SUPPRESS)
    p.add_argument("--size", default="small", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tree", default="", help=argparse.SUPPRESS)
    return p


def _only_the_tree() -> None:
    """Drop the editable install's import hooks, so that every rollstream / schemas module comes from the
    tree on PYTHONPATH (the hooks would fill in modules an older tree lacks from the installed one)."""

    def editable(hook: Any) -> bool:
        return "__editable__" in str(getattr(hook, "__module__", ""))

    sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
    sys.path_importer_cache.clear()


def main(argv: Sequence[str] | None = None) -> int:
    """Alternate the trees over the size classes and print the table (or run one process role)."""
    args = build_parser().parse_args(argv)
    if args.role != "driver":
        _only_the_tree()
    if args.role == "producer":
        run_producer(args.url, args.stream, args.size, args.count)
        return 0
    if args.role == "consumer":
        print(json.dumps(run_consumer(args.url, args.stream, args.size, args.count, args.tree)))
        return 0
    trees = [str(Path(t).resolve()) for t in args.trees]
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if unknown := [s for s in sizes if s not in SIZES]:
        print(f"bench bus_e2e: unknown --sizes {unknown}, expected {list(SIZES)}", file=sys.stderr)
        return 2
    if args.role == "codec":
        print(json.dumps(run_codec(sizes)))
        return 0
    if args.codec:
        return codec_table(trees, sizes)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for size in sizes:
            order = trees if rep % 2 == 0 else trees[::-1]  # alternate who goes first
            for tree in order:
                count = max(10, round(COUNTS[size] * args.scale))
                runs.setdefault((size, tree), []).append(trial(tree, size, args.url, count))
    if args.json:
        print(json.dumps({f"{s} {t}": v for (s, t), v in runs.items()}, indent=1))
        return 0
    print("| size | tree | wire bytes | samples/s median (range) | / first tree |")
    print("|---|---|---:|---:|---:|")
    for size in sizes:
        base = statistics.median(x["samples_per_s"] for x in runs[(size, trees[0])])
        for tree in trees:
            rates = [x["samples_per_s"] for x in runs[(size, tree)]]
            med = statistics.median(rates)
            print(
                f"| {size} | {tree} | {runs[(size, tree)][0]['wire_bytes']:,} | {med:,.0f} "
                f"({min(rates):,.0f}-{max(rates):,.0f}) | {med / base:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
