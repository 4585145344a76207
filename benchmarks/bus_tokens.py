"""Token-equal bus benchmark (`rollstream bench bus --tokens 8x512x2048,8x512x16384`): samples sized by
tokens (n rows, prompt and response lengths, a 151,936-id vocabulary as Qwen's) rather than by bytes.

Per shape, interleaved repetitions of two trials that move the same samples: ours (RolloutSample schema 5,
the ragged batch) and raw redis-py moving one opaque field of our entry's size. Also per shape: wire bytes
per response token per row, and decode µs against pickle. The bytes/token table measures the marginal
cost of one more response token per row and one more prompt token per group (n = 8).
"""

from __future__ import annotations

import importlib
import statistics
from dataclasses import dataclass, field
from typing import Any

import redis

from benchmarks.bus_trials import (
    PRODUCER,
    VOCAB,
    Settings,
    Trial,
    _per_call_us,
    fresh_stream,
    trial_inputs,
    trial_ours,
    trial_raw,
    wire_size,
)
from rollstream.bus import Publisher
from rollstream.testing.fakes import fake_rollout_sample
from schemas import RolloutSample, decode, encode


@dataclass
class TokenResult:
    """Everything measured at one (n, prompt, response) shape."""

    n: int
    prompt_len: int
    response_len: int
    wire: int
    samples_per_trial: int
    batch: int
    trials: dict[str, list[Trial]] = field(default_factory=dict)
    codec_us: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """Median samples/s of each trial kind, ours/raw, and bytes per response token per row."""
        rate = {
            k: self.samples_per_trial / statistics.median(t.total_s for t in v)
            for k, v in self.trials.items()
        }
        codec = {k: statistics.median(v) for k, v in self.codec_us.items()}
        return {
            **{f"{k}_samples_per_s": v for k, v in rate.items()},
            "ours_over_raw": rate["ours"] / rate["raw"],
            "bytes_per_token": self.wire / (self.n * self.response_len),
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


def marginal_bytes(n: int = 8) -> dict[str, float]:
    """Wire bytes of one more response token per row and of one more prompt token per group (full rows)."""

    def size(prompt_len: int, response_len: int) -> int:
        sample = fake_rollout_sample("m", n=n, prompt_len=prompt_len, response_len=response_len, vocab=VOCAB)
        return wire_size(encode(sample))

    base = size(512, 1024)
    return {
        "per_response_token_per_row": (size(512, 2048) - base) / (n * 1024),
        "per_prompt_token_per_group": (size(1024, 1024) - base) / 512,
    }


def _codec_round(r: redis.Redis, sample: RolloutSample, min_s: float, prefix: str) -> dict[str, float]:
    """µs per decode of our entry as Redis returns it and of pickle's blob, and per encode."""
    pickle = importlib.import_module("pickle")  # the baseline being measured, never a read path
    with fresh_stream(r, prefix) as keys:
        Publisher(r).publish(keys.rollouts_of(PRODUCER), sample)
        entries: Any = r.xrange(keys.rollouts_of(PRODUCER), count=1)
        fields = entries[0][1]
    blob = pickle.dumps(sample, protocol=5)
    return {
        "decode_ours": _per_call_us(lambda: decode(fields), min_s),
        "decode_pickle": _per_call_us(lambda: pickle.loads(blob), min_s),
        "encode_ours": _per_call_us(lambda: encode(sample), min_s),
    }


def measure_shape(r: redis.Redis, shape: tuple[int, int, int], s: Settings) -> TokenResult:
    """Interleaved ours / raw trials of the same samples at one token shape."""
    sample = token_sample(*shape)
    wire, payload, batch, count = trial_inputs(sample, s.mb_per_trial, s.batch)
    res = TokenResult(*shape, wire, count, batch)
    trials = {
        "ours": lambda k: trial_ours(r, sample, k, batch, s.prefix),
        "raw": lambda k: trial_raw(r, payload, k, batch, s.prefix),
    }
    if s.warmup:
        for run in trials.values():
            run(min(count, 2 * batch))
    names = list(trials)
    for rep in range(s.reps):
        for name in names[rep % 2 :] + names[: rep % 2]:  # alternate who goes first
            res.trials.setdefault(name, []).append(trials[name](count))
        for k, v in _codec_round(r, sample, s.codec_min_s, s.prefix).items():
            res.codec_us.setdefault(k, []).append(v)
    return res


def run_tokens(r: redis.Redis, shapes: list[tuple[int, int, int]], s: Settings) -> dict[str, Any]:
    """The token-equal report: marginal bytes per token and one row per shape."""
    results = [measure_shape(r, shape, s) for shape in shapes]
    return {
        "bytes_per_token": marginal_bytes(),
        "shapes": [
            {
                "shape": f"{x.n}x{x.prompt_len}x{x.response_len}",
                "n": x.n,
                "prompt_len": x.prompt_len,
                "response_len": x.response_len,
                "wire": x.wire,
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
        f"| schema 5 | {bpt['per_response_token_per_row']:.2f} | {bpt['per_prompt_token_per_group']:.2f} |",
        "",
        "| n x prompt x response | batch | B/token | samples/s ours | samples/s raw | ours/raw "
        "| decode µs ours / pickle |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["shapes"]:
        lines.append(
            f"| {row['shape']} | {row['batch']} | {row['bytes_per_token']:.1f} "
            f"| {row['ours_samples_per_s']:,.1f} | {row['raw_samples_per_s']:,.1f} "
            f"| {row['ours_over_raw']:.2f} "
            f"| {row['decode_ours_us']:,.0f} / {row['decode_pickle_us']:,.0f} |"
        )
    return "\n".join(lines) + "\n"
