"""Training accuracy of an rg:basic_arithmetic run per kind of problem and version, read from its log.

    .venv/bin/python scripts/arith_kinds.py runs/demo [BUCKET]

Reads every rollout of the run (live, or a stopped run served read-only from its files) and prints, per
BUCKET versions (default 10) and per kind (`add`, `sub_pos`, `sub_neg` for a negative result, `mulAxB` by
operand digits), three shares of the sampled answers: right, the right magnitude with the wrong sign, and
negative. A 2-term problem "Calculate A op B." only; other prompts are skipped.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any, cast

from rollstream.bus.ids import text as as_text
from rollstream.ops.inspect import stream_key
from rollstream.ops.log_server import serve_stopped_log
from rollstream.ops.plan import producer_names
from rollstream.ops.run_target import open_run
from rollstream.tasks.reasoning_gym import extract_answer
from schemas import RolloutSample
from schemas.codec import decode

_PROBLEM = re.compile(r"Calculate (\d+) ([-+*]) (\d+)\.")


def kind_of(a: str, op: str, b: str) -> tuple[str, int]:
    """The problem's kind and its true result."""
    x, y = int(a), int(b)
    truth = x + y if op == "+" else x - y if op == "-" else x * y
    if op == "*":
        hi, lo = sorted((len(a), len(b)), reverse=True)
        return f"mul{hi}x{lo}", truth
    if op == "-":
        return ("sub_neg" if truth < 0 else "sub_pos"), truth
    return "add", truth


def samples(run_dir: str) -> Iterator[RolloutSample]:
    """Every rollout sample of every producer of the run, in stream order."""
    with serve_stopped_log(open_run(None, [], run_dir)) as t:
        r = t.connect()
        for producer in producer_names(t.cfg):
            last = "-"
            key = stream_key(t.keys, f"rollouts:{producer}")
            while entries := [e for e in r.xrange(key, min=last, count=200) or [] if as_text(e[0]) != last]:
                for entry_id, fields in entries:
                    last = as_text(entry_id)
                    event = decode(cast(Mapping[bytes, Any], fields or {}))
                    if isinstance(event, RolloutSample):
                        yield event


def tally(run_dir: str, bucket: int) -> dict[tuple[int, str], list[int]]:
    """(version bucket, kind) -> [answers, right, right magnitude wrong sign, negative]."""
    counts: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for s in samples(run_dir):
        found = _PROBLEM.match(str(s.full_batch.non_tensors["raw_prompt"][0]))
        if not found:
            continue
        kind, truth = kind_of(*found.groups())
        row = counts[(s.param_version // bucket * bucket, kind)]
        for text in s.full_batch.non_tensors["response_text"]:
            answer = extract_answer(str(text), "last_number")
            value = float(answer) if answer is not None else None
            row[0] += 1
            row[1] += value == truth
            row[2] += value is not None and truth != 0 and value == -truth
            row[3] += value is not None and value < 0
    return counts


def main() -> None:
    """Print the table for the run dir in argv[1] (bucket of versions in argv[2], default 10)."""
    counts = tally(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
    versions = sorted({v for v, _ in counts})
    kinds = sorted({k for _, k in counts})
    print("version " + " ".join(f"{k:>22}" for k in kinds) + "   (right / wrong sign / negative, answers)")
    for v in versions:
        cells = []
        for k in kinds:
            c = counts.get((v, k))
            cells.append(f"{c[1] / c[0]:.2f}/{c[2] / c[0]:.2f}/{c[3] / c[0]:.2f} n{c[0]:<5}" if c else "")
        print(f"{v:<7} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
