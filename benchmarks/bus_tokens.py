"""Token-equal bus benchmark (`rollstream bench bus --tokens 8x512x2048,8x512x16384`): samples sized by
tokens (n rows, prompt and response lengths, a 151,936-id vocabulary as Qwen's) rather than by bytes, so
the compact layout's gain shows as samples/s at equal work.

Per shape, interleaved repetitions of three trials that move the same samples: ours with RolloutSample
schema 2 (compact), ours with schema 1 (the plain batch layout before issue 17), and raw redis-py moving
one opaque field of the compact entry's size. Also per shape: wire bytes per response token per row of
each layout, and decode µs of each against pickle. The bytes/token table measures the marginal cost of
one more response token per row and one more prompt token per group (n = 8), old and new layout.
"""

from __future__ import annotations

import importlib
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

import redis

from benchmarks.bus import (
    MiB,
    Settings,
    Trial,
    _per_call_us,
    default_batch,
    fresh_stream,
    trial_ours,
    trial_raw,
    wire_size,
)
from rollstream.bus import Publisher
from rollstream.fakes import fake_rollout_sample
from schemas import RolloutSample, decode, encode

VOCAB = 151_936  # token ids up to Qwen2's vocabulary: 4 bytes each on the wire


@dataclass
class TokenResult:
    """Everything measured at one (n, prompt, response) shape."""

    n: int
    prompt_len: int
    response_len: int
    wire_compact: int
    wire_plain: int
    samples_per_trial: int
    batch: int
    trials: dict[str, list[Trial]] = field(default_factory=dict)
    codec_us: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """Median samples/s of each trial kind, the gain, and bytes per response token per row."""
        rate = {
            k: self.samples_per_trial / statistics.median(t.total_s for t in v)
            for k, v in self.trials.items()
        }
        codec = {k: statistics.median(v) for k, v in self.codec_us.items()}
        tokens = self.n * self.response_len
        return {
            **{f"{k}_samples_per_s": v for k, v in rate.items()},
            "compact_over_plain": rate["compact"] / rate["plain"],
            "compact_over_raw": rate["compact"] / rate["raw"],
            "bytes_per_token_compact": self.wire_compact / tokens,
            "bytes_per_token_plain": self.wire_plain / tokens,
            **{f"{k}_us": v for k, v in codec.items()},
        }


def parse_shape(text: str) -> tuple[int, int, int]:
    """'8x512x2048' -> (n, prompt_len, response_len)."""
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) != 3 or min(parts) < 1:
        raise ValueError(f"token shape {text!r} is not NxPROMPTxRESPONSE with positive ints")
    return parts[0], parts[1], parts[2]


def token_sample(n: int, prompt_len: int, response_len: int) -> RolloutSample:
    """A fake sample of this shape: one shared prompt, ragged responses, ids below VOCAB."""
    return fake_rollout_sample(
        f"tok-{n}x{prompt_len}x{response_len}",
        n=n,
        prompt_len=prompt_len,
        response_len=response_len,
        ragged=True,
        vocab=VOCAB,
    )


def marginal_bytes(compact: bool, n: int = 8) -> dict[str, float]:
    """Wire bytes of one more response token per row and of one more prompt token per group (full rows)."""

    def size(prompt_len: int, response_len: int) -> int:
        sample = fake_rollout_sample("m", n=n, prompt_len=prompt_len, response_len=response_len, vocab=VOCAB)
        return wire_size(encode(sample, compact=compact))

    base = size(512, 1024)
    return {
        "per_response_token_per_row": (size(512, 2048) - base) / (n * 1024),
        "per_prompt_token_per_group": (size(1024, 1024) - base) / 512,
    }


def _codec_round(r: redis.Redis, sample: RolloutSample, min_s: float, prefix: str) -> dict[str, float]:
    """µs per decode of the compact and plain entries as Redis returns them, and of pickle's blob."""
    pickle = importlib.import_module("pickle")  # the baseline being measured, never a read path
    fields = {}
    with fresh_stream(r, prefix) as keys:
        for compact in (True, False):
            Publisher(r, compact=compact).publish(keys.rollouts, sample)
        entries: Any = r.xrange(keys.rollouts, count=2)
        fields = {"compact": entries[0][1], "plain": entries[1][1]}
    blob = pickle.dumps(sample, protocol=5)
    return {
        "decode_compact": _per_call_us(lambda: decode(fields["compact"]), min_s),
        "decode_plain": _per_call_us(lambda: decode(fields["plain"]), min_s),
        "decode_pickle": _per_call_us(lambda: pickle.loads(blob), min_s),
        "encode_compact": _per_call_us(lambda: encode(sample), min_s),
    }


def measure_shape(r: redis.Redis, shape: tuple[int, int, int], s: Settings) -> TokenResult:
    """Interleaved compact / plain / raw trials of the same samples at one token shape."""
    sample = token_sample(*shape)
    wire_compact, wire_plain = wire_size(encode(sample)), wire_size(encode(sample, compact=False))
    payload = os.urandom(wire_compact - len("payload"))
    batch = s.batch or default_batch(wire_plain)
    count = max(batch, round(s.mb_per_trial * MiB / wire_plain))
    res = TokenResult(*shape, wire_compact, wire_plain, count, batch)
    trials = {
        "compact": lambda k: trial_ours(r, sample, k, batch, s.prefix, compact=True),
        "plain": lambda k: trial_ours(r, sample, k, batch, s.prefix, compact=False),
        "raw": lambda k: trial_raw(r, payload, k, batch, s.prefix),
    }
    if s.warmup:
        for run in trials.values():
            run(min(count, 2 * batch))
    names = list(trials)
    for rep in range(s.reps):
        for name in names[rep % 3 :] + names[: rep % 3]:  # rotate who goes first
            res.trials.setdefault(name, []).append(trials[name](count))
        for k, v in _codec_round(r, sample, s.codec_min_s, s.prefix).items():
            res.codec_us.setdefault(k, []).append(v)
    return res


def run_tokens(r: redis.Redis, shapes: list[tuple[int, int, int]], s: Settings) -> dict[str, Any]:
    """The token-equal report: marginal bytes per token (old and new) and one row per shape."""
    results = [measure_shape(r, shape, s) for shape in shapes]
    return {
        "bytes_per_token": {"plain": marginal_bytes(False), "compact": marginal_bytes(True)},
        "shapes": [
            {
                "shape": f"{x.n}x{x.prompt_len}x{x.response_len}",
                "n": x.n,
                "prompt_len": x.prompt_len,
                "response_len": x.response_len,
                "wire_compact": x.wire_compact,
                "wire_plain": x.wire_plain,
                "samples_per_trial": x.samples_per_trial,
                "batch": x.batch,
                **x.summary(),
            }
            for x in results
        ],
    }


def format_tokens(report: dict[str, Any]) -> str:
    """Markdown tables of a token-equal report."""
    bpt = report["bytes_per_token"]
    lines = [
        "| layout | bytes per response token per row | bytes per prompt token per group (n = 8) |",
        "|---|---:|---:|",
        *(
            f"| {name} | {bpt[name]['per_response_token_per_row']:.2f} | {bpt[name]['per_prompt_token_per_group']:.2f} |"
            for name in ("plain", "compact")
        ),
        "",
        "| n x prompt x response | batch | B/token plain → compact | samples/s plain | samples/s compact "
        "| compact/plain | compact/raw | decode µs plain / compact / pickle |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for row in report["shapes"]:
        lines.append(
            f"| {row['shape']} | {row['batch']} | {row['bytes_per_token_plain']:.1f} → {row['bytes_per_token_compact']:.1f} "
            f"| {row['plain_samples_per_s']:,.1f} | {row['compact_samples_per_s']:,.1f} "
            f"| {row['compact_over_plain']:.2f} | {row['compact_over_raw']:.2f} "
            f"| {row['decode_plain_us']:,.0f} / {row['decode_compact_us']:,.0f} / {row['decode_pickle_us']:,.0f} |"
        )
    return "\n".join(lines) + "\n"
