"""Bus benchmark: RolloutSample throughput through our publish → GroupReader → decode → ack path, against a
raw redis-py baseline moving the same bytes, plus our codec against pickle (baseline only).

Per sample size (default ~16 KB, 256 KB, 4 MB on the wire) and per repetition, "ours" and "raw" trials
alternate so that machine drift hits both alike; the table reports medians and their ratio.

- ours: `Publisher.publish_many` of a batch (encode + pipelined XADD), then `GroupReader.poll` (XREADGROUP
  COUNT batch + decode to a validated RolloutSample) until the batch is in, then one `GroupReader.ack`.
- raw: the same cycle with one opaque `payload` field of the same total size: pipelined XADD of the batch,
  XREADGROUP COUNT batch, one XACK. No encoding, no decoding. It uses the very client ours uses (as
  `connect()` builds it: rollstream's RESP command packer, redis-py's hiredis reply parser) in the same
  process, which tuned its allocator and froze its start-up heap first as workers do; `--packer
  python|hiredis` puts both on one of redis-py's own command packers instead (raw is no faster with either:
  BENCHMARKS.md, Bus).

Each trial uses a fresh run namespace (`Keys(f"{prefix}-<uuid>")`) whose keys are deleted afterwards. Run:
`rollstream bench bus [--quick] [--json] [--sizes 16K,256K,4M] [--redis-url URL]`; `--tokens` for the
token-equal mode (benchmarks/bus_tokens.py), `--phases` for µs per sample of each phase
(benchmarks/bus_phases.py).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from redis.connection import Encoder, HiredisRespSerializer, PythonRespSerializer

from rollstream.bus import GroupReader, Message, Publisher, connect, delete_run, ensure_group
from rollstream.fakes import fake_rollout_sample, response_len_for_bytes
from rollstream.names import TRAINER_GROUP, Keys
from rollstream.worker import freeze_startup_heap, tune_allocator
from schemas import RolloutSample, decode, decode_as, encode

MiB = 1 << 20
VOCAB = 151_936  # token ids up to Qwen2's vocabulary: int32 on the wire
DEFAULT_URL = os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
DEFAULT_SIZES = "16K,256K,4M"
CONSUMER = "bench"


@dataclass
class Settings:
    """What one benchmark run measures and how long it spends."""

    sizes: list[int]  # target wire bytes per sample
    mb_per_trial: float = 48.0  # MB each trial moves (sample count = this / sample size)
    reps: int = 5  # interleaved ours/raw repetitions per size
    batch: int | None = None  # samples per publish pipeline and per XREADGROUP COUNT; None = by size
    codec_min_s: float = 0.03  # minimum time of one timed codec loop
    warmup: bool = True  # one untimed ours+raw trial per size first
    prefix: str = "bench"  # run-name prefix of the benchmark's Redis namespaces
    packer: str = "client"  # command packer: client (as connect() builds it), python or hiredis


@dataclass
class Trial:
    """One timed pass of samples through the bus."""

    total_s: float
    publish_s: float
    consume_s: float


@dataclass
class SizeResult:
    """Everything measured at one sample size (times in seconds, codec in µs per sample)."""

    target_bytes: int
    wire_bytes: int
    samples_per_trial: int
    batch: int
    ours: list[Trial] = field(default_factory=list)
    raw: list[Trial] = field(default_factory=list)
    codec_us: dict[str, list[float]] = field(default_factory=dict)

    def median_s(self, which: str, part: str = "total_s") -> float:
        """Median seconds of a trial part over repetitions ('ours' or 'raw')."""
        return statistics.median(getattr(t, part) for t in getattr(self, which))

    def summary(self) -> dict[str, float]:
        """Median rates, ratios and codec times of this size."""
        n, mb = self.samples_per_trial, self.samples_per_trial * self.wire_bytes / 1e6
        ours_s, raw_s = self.median_s("ours"), self.median_s("raw")
        codec = {k: statistics.median(v) for k, v in self.codec_us.items()}
        return {
            "ours_samples_per_s": n / ours_s,
            "ours_mb_per_s": mb / ours_s,
            "raw_samples_per_s": n / raw_s,
            "raw_mb_per_s": mb / raw_s,
            "ours_over_raw": raw_s / ours_s,
            "ours_publish_s": self.median_s("ours", "publish_s"),
            "ours_consume_s": self.median_s("ours", "consume_s"),
            "raw_publish_s": self.median_s("raw", "publish_s"),
            "raw_consume_s": self.median_s("raw", "consume_s"),
            **{f"{k}_us": v for k, v in codec.items()},
            "decode_pickle_over_ours": codec["decode_pickle"] / codec["decode_ours"],
            "encode_pickle_over_ours": codec["encode_pickle"] / codec["encode_ours"],
        }


# --- sizes and samples --------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'16K' / '256k' / '4M' / '4096' -> bytes (K = 1024)."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    value = int(float(t[:-1] if mult > 1 else t) * mult)
    if value < 256:
        raise ValueError(f"sample size {text!r} is below 256 bytes")
    return value


def human_size(n: int) -> str:
    """Bytes as '16 KB' / '4.0 MB' (binary units)."""
    return f"{n / MiB:.1f} MB" if n >= MiB else f"{n / 1024:.0f} KB"


def wire_size(fields: dict[str, Any]) -> int:
    """Bytes an entry's field names and values take on the wire."""
    return sum(len(k) + memoryview(v).nbytes for k, v in fields.items())


def make_sample(target_bytes: int) -> RolloutSample:
    """A fake RolloutSample of about target_bytes encoded (ids of a Qwen-sized vocabulary: int32 on the wire):
    response_len_for_bytes' guess, corrected by measuring the encoded size at two lengths (bytes grow
    linearly with response length)."""
    guess = response_len_for_bytes(target_bytes)
    small = wire_size(encode(fake_rollout_sample("x", response_len=1, vocab=VOCAB)))
    large = wire_size(encode(fake_rollout_sample("x", response_len=guess + 1, vocab=VOCAB)))
    per_token = (large - small) / guess
    length = max(1, round(1 + (target_bytes - small) / per_token))
    return fake_rollout_sample(f"bench-{target_bytes}", response_len=length, vocab=VOCAB)


def default_batch(wire_bytes: int) -> int:
    """Samples per pipeline/XREADGROUP: about 4 MB per batch, between 1 and 64 samples."""
    return max(1, min(64, (4 * MiB) // wire_bytes))


@contextmanager
def fresh_stream(r: redis.Redis, prefix: str) -> Iterator[Keys]:
    """A new run namespace with its rollouts stream and trainer group; every key of it deleted afterwards."""
    keys = Keys(f"{prefix}-{uuid.uuid4().hex[:12]}")
    ensure_group(r, keys.rollouts, TRAINER_GROUP)
    try:
        yield keys
    finally:
        delete_run(r, keys)


def _batches(total: int, batch: int) -> Iterator[int]:
    """Sizes of consecutive batches covering total."""
    for start in range(0, total, batch):
        yield min(batch, total - start)


# --- one trial each -----------------------------------------------------------------------------


def trial_ours(r: redis.Redis, sample: RolloutSample, n_samples: int, batch: int, prefix: str) -> Trial:
    """Publish/read/decode/ack n_samples through Publisher and GroupReader, batch by batch."""
    with fresh_stream(r, prefix) as keys:
        pub = Publisher(r, nomkstream=True)
        reader = GroupReader(r, keys.rollouts, TRAINER_GROUP, CONSUMER, dead_stream=keys.dead, count=batch)
        reader.poll(block_ms=0)  # prime: own-pending scan and first XAUTOCLAIM happen once per reader
        publish_s = consume_s = 0.0
        got = 0
        for b in _batches(n_samples, batch):
            t0 = time.perf_counter()
            pub.publish_many(keys.rollouts, [sample] * b)
            t1 = time.perf_counter()
            msgs: list[Message] = []
            while len(msgs) < b:
                msgs.extend(reader.poll(block_ms=1000))
            reader.ack([m.id for m in msgs])
            consume_s += time.perf_counter() - t1
            publish_s += t1 - t0
            got += sum(isinstance(m.event, RolloutSample) for m in msgs)
        if got != n_samples or reader.stats.dead:
            raise RuntimeError(f"ours: decoded {got}/{n_samples} samples, {reader.stats.dead} dead-lettered")
    return Trial(publish_s + consume_s, publish_s, consume_s)


def trial_raw(r: Any, payload: bytes, n_samples: int, batch: int, prefix: str) -> Trial:
    """The baseline: the same cycle with one opaque payload field, plain redis-py calls."""
    with fresh_stream(r, prefix) as keys:
        stream = keys.rollouts
        publish_s = consume_s = 0.0
        got = 0
        for b in _batches(n_samples, batch):
            t0 = time.perf_counter()
            pipe = r.pipeline(transaction=False)
            for _ in range(b):
                pipe.xadd(stream, {"payload": payload})
            pipe.execute()
            t1 = time.perf_counter()
            entries: list[Any] = []
            while len(entries) < b:
                resp = r.xreadgroup(TRAINER_GROUP, CONSUMER, {stream: ">"}, count=b, block=1000)
                entries.extend(resp[0][1] if resp else [])
            r.xack(stream, TRAINER_GROUP, *[i for i, _ in entries])
            consume_s += time.perf_counter() - t1
            publish_s += t1 - t0
            got += sum(len(f[b"payload"]) == len(payload) for _, f in entries)
        if got != n_samples:
            raise RuntimeError(f"raw: read {got}/{n_samples} payloads")
    return Trial(publish_s + consume_s, publish_s, consume_s)


# --- codec ----------------------------------------------------------------------------------------


def _per_call_us(fn: Callable[[], object], min_s: float) -> float:
    """µs per call of fn, looping until at least min_s has passed."""
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s:
            return elapsed / calls * 1e6


def codec_round(r: redis.Redis, sample: RolloutSample, min_s: float, prefix: str) -> dict[str, float]:
    """One interleaved round of encode/decode timings, ours vs pickle protocol 5, and the trainer's side:
    decode plus its share of assembling a mini-batch of 8 such samples into one padded batch (µs per sample).

    Our decode reads the fields exactly as Redis returns them (bytes keys and values; arrays are viewed
    zero-copy); pickle decodes its own blob, which copies every array out of it."""
    from consumers.trainer.assembly import assemble_micro_batches  # (the trainer's: benchmarks sit above it)

    # pickle is the baseline being measured here, never a read path: nothing it loads comes from the wire.
    pickle = importlib.import_module("pickle")
    with fresh_stream(r, prefix) as keys:
        Publisher(r).publish(keys.rollouts, sample)
        entries: Any = r.xrange(keys.rollouts, count=1)
        fields = entries[0][1]  # {bytes: bytes}, as every reader gets it
    blob = pickle.dumps(sample, protocol=5)
    return {
        "encode_ours": _per_call_us(lambda: encode(sample), min_s),
        "encode_pickle": _per_call_us(lambda: pickle.dumps(sample, protocol=5), min_s),
        "decode_ours": _per_call_us(lambda: decode(fields), min_s),
        "decode_pickle": _per_call_us(lambda: pickle.loads(blob), min_s),
        "decode_assemble": _per_call_us(
            lambda: assemble_micro_batches([decode_as(fields, RolloutSample) for _ in range(8)]), min_s
        )
        / 8,
    }


# --- the run ------------------------------------------------------------------------------------


def measure_size(r: redis.Redis, target_bytes: int, s: Settings) -> SizeResult:
    """Interleaved ours/raw trials and codec rounds at one sample size."""
    sample = make_sample(target_bytes)
    wire = wire_size(encode(sample))
    payload = os.urandom(wire - len("payload"))
    batch = s.batch or default_batch(wire)
    n = max(batch, round(s.mb_per_trial * MiB / wire))
    res = SizeResult(target_bytes, wire, n, batch)
    if s.warmup:
        trial_ours(r, sample, min(n, 2 * batch), batch, s.prefix)
        trial_raw(r, payload, min(n, 2 * batch), batch, s.prefix)
    for rep in range(s.reps):
        # alternate who goes first so neither always runs right after the codec loops
        order = [trial_ours, trial_raw] if rep % 2 == 0 else [trial_raw, trial_ours]
        for fn in order:
            if fn is trial_ours:
                res.ours.append(trial_ours(r, sample, n, batch, s.prefix))
            else:
                res.raw.append(trial_raw(r, payload, n, batch, s.prefix))
        for k, v in codec_round(r, sample, s.codec_min_s, s.prefix).items():
            res.codec_us.setdefault(k, []).append(v)
    return res


def bench_client(url: str, packer: str) -> redis.Redis:
    """A client as workers get it from connect() (rollstream.bus.connection.RespPacker), optionally with one
    of redis-py's RESP command packers: its pure-Python one sends every memoryview and value over 6000 bytes
    as its own socket write; the hiredis one copies everything into one buffer (each memoryview to bytes
    first)."""
    r = connect(url, retries=0, socket_timeout_s=30.0)
    if packer == "python":
        encoder = Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)
        r.connection_pool.connection_kwargs["command_packer"] = PythonRespSerializer(6000, encoder.encode)
    elif packer == "hiredis":
        r.connection_pool.connection_kwargs["command_packer"] = HiredisRespSerializer()
    elif packer != "client":
        raise ValueError(f"unknown packer {packer!r} (client, python, hiredis)")
    return r


def packer_name(r: redis.Redis) -> str:
    """Class name of the command packer r's connections use."""
    conn: Any = r.connection_pool.get_connection()
    try:
        return type(conn._command_packer).__name__
    finally:
        r.connection_pool.release(conn)


def run_bench(
    url: str, s: Settings, shapes: list[tuple[int, int, int]] | None = None, phases: bool = False
) -> dict[str, Any]:
    """Measure every size (or, given token shapes, the token-equal mode of benchmarks.bus_tokens; with
    phases, benchmarks.bus_phases per size instead); returns the JSON-ready report (settings, machine,
    bytes per token, per-size medians and trials, phase rows)."""
    from benchmarks import bus_phases, bus_tokens  # (they build on this module)

    r = bench_client(url, s.packer)
    tune_allocator()  # as every worker does at start, and
    freeze_startup_heap()  # once built (ours and raw run in this one process alike)
    try:
        packer = packer_name(r)
        info: Any = r.info("server")
        rows = [bus_phases.measure_phases(r, size, s) for size in s.sizes] if phases else []
        results = [] if shapes or phases else [measure_size(r, size, s) for size in s.sizes]
        tokens = bus_tokens.run_tokens(r, shapes or [], s)
    finally:
        r.close()
        gc.unfreeze()  # (the process may go on: a test calling main())
    return {
        **tokens,
        "phases": rows,
        "settings": asdict(s),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "redis": info.get("redis_version"),
            "redis_url": url.split("@")[-1],
            "command_packer": packer,
        },
        "sizes": [
            {
                "size": human_size(res.wire_bytes),
                "target_bytes": res.target_bytes,
                "wire_bytes": res.wire_bytes,
                "samples_per_trial": res.samples_per_trial,
                "batch": res.batch,
                **res.summary(),
                "trials": {"ours": [asdict(t) for t in res.ours], "raw": [asdict(t) for t in res.raw]},
                "codec_us_rounds": res.codec_us,
            }
            for res in results
        ],
    }


def format_table(report: dict[str, Any]) -> str:
    """The markdown tables of a report's medians (bytes per token first)."""
    from benchmarks.bus_tokens import format_tokens

    tokens = format_tokens(report)
    if report.get("phases"):
        from benchmarks.bus_phases import format_phases

        return tokens.split("\n\n")[0] + "\n\n" + format_phases(report["phases"])
    if not report["sizes"]:
        return tokens
    lines = [
        tokens.split("\n\n")[0],
        "",
        "| size | batch | ours samples/s | ours MB/s | raw MB/s | ours/raw "
        "| encode µs ours vs pickle | decode µs ours vs pickle | decode pickle/ours | decode + assembly µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["sizes"]:
        lines.append(
            f"| {row['size']} | {row['batch']} | {row['ours_samples_per_s']:,.0f} "
            f"| {row['ours_mb_per_s']:,.0f} "
            f"| {row['raw_mb_per_s']:,.0f} | {row['ours_over_raw']:.2f} "
            f"| {row['encode_ours_us']:,.0f} vs {row['encode_pickle_us']:,.0f} "
            f"| {row['decode_ours_us']:,.0f} vs {row['decode_pickle_us']:,.0f} "
            f"| {row['decode_pickle_over_ours']:.2f} | {row['decode_assemble_us']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `rollstream bench bus`."""
    p = argparse.ArgumentParser(prog="rollstream bench bus", description=__doc__.splitlines()[0])
    p.add_argument(
        "--redis-url", default=DEFAULT_URL, help="Redis to benchmark against (keys are cleaned up)"
    )
    p.add_argument(
        "--sizes", default=DEFAULT_SIZES, help="comma-separated sample sizes on the wire, e.g. 16K,4M"
    )
    p.add_argument(
        "--mb-per-trial", type=float, default=None, help="MB each trial moves (default 48; quick 2)"
    )
    p.add_argument(
        "--reps", type=int, default=None, help="interleaved ours/raw repetitions per size (default 5)"
    )
    p.add_argument(
        "--batch", type=int, default=None, help="samples per pipeline and XREADGROUP (default ~4 MB)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a few seconds: small trials, 2 repetitions, no warm-up"
    )
    p.add_argument("--json", action="store_true", help="print the full report as JSON instead of the table")
    p.add_argument(
        "--packer",
        default="client",
        choices=["client", "python", "hiredis"],
        help="RESP command packer of ours and raw: as connect() builds it (client), or redis-py's "
        "pure-Python or hiredis one",
    )
    p.add_argument("--prefix", default="bench", help="run-name prefix of the benchmark's Redis namespaces")
    p.add_argument(
        "--phases",
        action="store_true",
        help="instead of the rates: µs per sample of each phase (encode, XADD, XREADGROUP, decode, "
        "XACK, gc) at each --sizes, against raw's",
    )
    p.add_argument(
        "--tokens",
        default=None,
        const="8x512x2048,8x512x16384",
        nargs="?",
        help="token-equal mode instead of --sizes: comma-separated NxPROMPTxRESPONSE shapes "
        "(alone: 8x512x2048,8x512x16384); ours vs raw at equal tokens",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bus benchmark and print the markdown table (or --json); returns an exit code."""
    args = build_parser().parse_args(argv)
    try:
        sizes = [parse_size(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError as e:
        print(f"bench bus: bad --sizes: {e}", file=sys.stderr)
        return 2
    from benchmarks.bus_tokens import parse_shape

    try:
        shapes = [parse_shape(x) for x in args.tokens.split(",") if x.strip()] if args.tokens else None
    except ValueError as e:
        print(f"bench bus: bad --tokens: {e}", file=sys.stderr)
        return 2
    s = Settings(
        sizes=sizes,
        mb_per_trial=args.mb_per_trial or (2.0 if args.quick else 48.0),
        reps=args.reps or (2 if args.quick else 5),
        batch=args.batch,
        codec_min_s=0.003 if args.quick else 0.03,
        warmup=not args.quick,
        prefix=args.prefix,
        packer=args.packer,
    )
    t0 = time.perf_counter()
    report = run_bench(args.redis_url, s, shapes, phases=args.phases)
    report["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        cmd = " ".join(["rollstream bench bus", *(argv if argv is not None else sys.argv[1:])])
        print(
            f"<!-- {cmd}: {report['machine']['cpus']} cpus, redis {report['machine']['redis']}, "
            f"{report['machine']['command_packer']}, "
            f"{s.reps} reps x {s.mb_per_trial:g} MB, {report['elapsed_s']:.0f} s -->"
        )
        print(format_table(report), end="")
    return 0
