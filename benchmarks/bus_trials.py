"""The bus benchmark's trials, below its three reports (benchmarks/bus.py: rates per size, bus_tokens.py:
token-equal shapes, bus_phases.py: µs per phase): settings, a calibrated fake sample, one ours and one raw
trial, the codec round against pickle, and the client as workers get it."""

from __future__ import annotations

import importlib
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis
from redis.connection import Encoder, HiredisRespSerializer, PythonRespSerializer

from rollstream.bus import GroupReader, Message, Publisher, connect, delete_run, ensure_group
from rollstream.keys import TRAINER_GROUP, Keys
from rollstream.testing.fakes import fake_rollout_sample, response_len_for_bytes
from schemas import RolloutSample, decode, decode_as, encode

MiB = 1 << 20
VOCAB = 151_936  # token ids up to Qwen2's vocabulary: int32 on the wire
DEFAULT_URL = os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
DEFAULT_SIZES = "16K,256K,4M"
CONSUMER = "bench"
#: The one producer whose rollouts stream the bus trials use (a run has one such stream per producer).
PRODUCER = "rollout_00"


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
    pickle: list[Trial] = field(default_factory=list)
    codec_us: dict[str, list[float]] = field(default_factory=dict)

    def median_s(self, which: str, part: str = "total_s") -> float:
        """Median seconds of a trial part over repetitions ('ours', 'raw' or 'pickle')."""
        return statistics.median(getattr(t, part) for t in getattr(self, which))

    def summary(self) -> dict[str, float]:
        """Median rates, ratios and codec times of this size."""
        n, mb = self.samples_per_trial, self.samples_per_trial * self.wire_bytes / 1e6
        ours_s, raw_s, pickle_s = self.median_s("ours"), self.median_s("raw"), self.median_s("pickle")
        codec = {k: statistics.median(v) for k, v in self.codec_us.items()}
        return {
            "ours_samples_per_s": n / ours_s,
            "ours_mb_per_s": mb / ours_s,
            "raw_samples_per_s": n / raw_s,
            "raw_mb_per_s": mb / raw_s,
            "ours_over_raw": raw_s / ours_s,
            "pickle_samples_per_s": n / pickle_s,
            "pickle_over_raw": raw_s / pickle_s,
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


class TrialInputs(NamedTuple):
    """What the trials of one sample move: its entry's bytes on the wire, raw's opaque payload making an
    entry of the same size, samples per pipeline/XREADGROUP, and samples per trial."""

    wire: int
    payload: bytes
    batch: int
    n: int


def trial_inputs(sample: RolloutSample, mb_per_trial: float, batch: int | None = None) -> TrialInputs:
    """TrialInputs of a sample: `batch` (default: default_batch) and about mb_per_trial MB per trial, at
    least one batch."""
    wire = wire_size(encode(sample))
    batch = batch or default_batch(wire)
    return TrialInputs(
        wire, os.urandom(wire - len("payload")), batch, max(batch, round(mb_per_trial * MiB / wire))
    )


@contextmanager
def fresh_stream(r: redis.Redis, prefix: str) -> Iterator[Keys]:
    """A new run namespace with its rollouts stream and trainer group; every key of it deleted afterwards."""
    keys = Keys(f"{prefix}-{uuid.uuid4().hex[:12]}")
    ensure_group(r, keys.rollouts_of(PRODUCER), TRAINER_GROUP)
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
        reader = GroupReader(
            r, keys.rollouts_of(PRODUCER), TRAINER_GROUP, CONSUMER, dead_stream=keys.dead, count=batch
        )
        reader.poll(block_ms=0)  # prime: own-pending scan and first XAUTOCLAIM happen once per reader
        publish_s = consume_s = 0.0
        got = 0
        for b in _batches(n_samples, batch):
            t0 = time.perf_counter()
            pub.publish_many(keys.rollouts_of(PRODUCER), [sample] * b)
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


def _one_field_trial(
    r: Any,
    payload_of: Callable[[], bytes],
    load: Callable[[bytes], Any],
    n_samples: int,
    batch: int,
    prefix: str,
) -> tuple[Trial, list[Any]]:
    """The cycle with one opaque `payload` field per entry, plain redis-py calls: each entry's bytes from
    payload_of() at publish (timed), load() of each read payload before the XACK (timed); returns the trial
    and every loaded value."""
    with fresh_stream(r, prefix) as keys:
        stream = keys.rollouts_of(PRODUCER)
        publish_s = consume_s = 0.0
        loaded: list[Any] = []
        for b in _batches(n_samples, batch):
            t0 = time.perf_counter()
            pipe = r.pipeline(transaction=False)
            for _ in range(b):
                pipe.xadd(stream, {"payload": payload_of()})
            pipe.execute()
            t1 = time.perf_counter()
            entries: list[Any] = []
            while len(entries) < b:
                resp = r.xreadgroup(TRAINER_GROUP, CONSUMER, {stream: ">"}, count=b, block=1000)
                entries.extend(resp[0][1] if resp else [])
            values = [load(f[b"payload"]) for _, f in entries]
            r.xack(stream, TRAINER_GROUP, *[i for i, _ in entries])
            consume_s += time.perf_counter() - t1
            publish_s += t1 - t0
            loaded.extend(values)
    return Trial(publish_s + consume_s, publish_s, consume_s), loaded


def trial_raw(r: Any, payload: bytes, n_samples: int, batch: int, prefix: str) -> Trial:
    """The baseline: the same cycle with one opaque payload field, plain redis-py calls (each read payload's
    length taken, nothing decoded)."""
    trial, lengths = _one_field_trial(r, lambda: payload, len, n_samples, batch, prefix)
    got = sum(n == len(payload) for n in lengths)
    if got != n_samples:
        raise RuntimeError(f"raw: read {got}/{n_samples} payloads")
    return trial


def trial_pickle(r: Any, sample: RolloutSample, n_samples: int, batch: int, prefix: str) -> Trial:
    """A second baseline: the raw cycle carrying the sample as one pickle (protocol 5) field, pickled at
    publish and unpickled after the read: what the fastest general Python codec, with none of our checks,
    costs end to end on the same bus (its entry is ~1 % larger than ours)."""
    pickle = importlib.import_module("pickle")  # the baseline being measured, never a read path
    trial, loaded = _one_field_trial(
        r, lambda: pickle.dumps(sample, protocol=5), pickle.loads, n_samples, batch, prefix
    )
    got = sum(type(x) is RolloutSample for x in loaded)
    if got != n_samples:
        raise RuntimeError(f"pickle: loaded {got}/{n_samples} samples")
    return trial


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
    # (the trainer's: benchmarks sit above it)
    import torch

    from consumers.trainer.assembly import assemble_batch_from_rollout_samples as assemble

    cpu = torch.device("cpu")

    # pickle is the baseline being measured here, never a read path: nothing it loads comes from the wire.
    pickle = importlib.import_module("pickle")
    with fresh_stream(r, prefix) as keys:
        Publisher(r).publish(keys.rollouts_of(PRODUCER), sample)
        entries: Any = r.xrange(keys.rollouts_of(PRODUCER), count=1)
        fields = entries[0][1]  # {bytes: bytes}, as every reader gets it
    blob = pickle.dumps(sample, protocol=5)
    return {
        "encode_ours": _per_call_us(lambda: encode(sample), min_s),
        "encode_pickle": _per_call_us(lambda: pickle.dumps(sample, protocol=5), min_s),
        "decode_ours": _per_call_us(lambda: decode(fields), min_s),
        "decode_pickle": _per_call_us(lambda: pickle.loads(blob), min_s),
        "decode_assemble": _per_call_us(
            lambda: assemble([decode_as(fields, RolloutSample) for _ in range(8)])[0].padded(None, cpu), min_s
        )
        / 8,
    }


# --- the run ------------------------------------------------------------------------------------


def measure_size(r: redis.Redis, target_bytes: int, s: Settings) -> SizeResult:
    """Interleaved ours/raw/pickle trials and codec rounds at one sample size."""
    sample = make_sample(target_bytes)
    wire, payload, batch, n = trial_inputs(sample, s.mb_per_trial, s.batch)
    res = SizeResult(target_bytes, wire, n, batch)
    if s.warmup:
        trial_ours(r, sample, min(n, 2 * batch), batch, s.prefix)
        trial_raw(r, payload, min(n, 2 * batch), batch, s.prefix)
        trial_pickle(r, sample, min(n, 2 * batch), batch, s.prefix)
    trials = {
        "ours": lambda: trial_ours(r, sample, n, batch, s.prefix),
        "raw": lambda: trial_raw(r, payload, n, batch, s.prefix),
        "pickle": lambda: trial_pickle(r, sample, n, batch, s.prefix),
    }
    for rep in range(s.reps):
        # rotate who goes first so none always runs right after the codec loops
        for which in [*trials][rep % 3 :] + [*trials][: rep % 3]:
            getattr(res, which).append(trials[which]())
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
