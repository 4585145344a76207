"""A producer's stats windows, as the aggregator's fold puts them into a step's record: the windows of one
producer in a step's span merged into one (`merge_windows`: samples and tokens add, rates and ratios over the
windows' seconds, the answer metrics weighted by samples, the newest version and swap check), and the merged
windows of every producer as the record's `producer/…` metrics, with the totals across producers
(`producer_metrics`). Pure: no Redis, no clock (consumers/aggregator/fold.py says which windows a span
holds)."""

from __future__ import annotations

import math

from rollstream.tasks.calculator import tool_ratios
from rollstream.weights.fingerprint import SWAP_CHECK_DIFF, SWAP_CHECK_DIFF_MAX, SWAP_CHECK_VERSION
from schemas import ANSWER_METRIC_PREFIX, ANSWER_METRICS, WINDOW_GEN_S, WINDOW_IDLE_S, WINDOW_S, ProducerStats

#: The swap check's metrics a producer's stats carry (producers/worker.py swap_check_metrics): per producer in
#: the record as `producer/<name>/swap_check/…`; across producers the worst diff and the oldest version.
SWAP_CHECK_METRICS = (SWAP_CHECK_VERSION, SWAP_CHECK_DIFF, SWAP_CHECK_DIFF_MAX)


def answer_metric_names(ev: ProducerStats) -> list[str]:
    """The names of the answer metrics (schemas' ANSWER_METRICS, ANSWER_METRIC_PREFIX…) a stats event
    carries: per producer in the record as `producer/<name>/acc`, `…/reward/<task metric>`; across producers
    (answer_metrics_across) under the stats' own names (`producer/acc`: training accuracy at the sampling
    temperature, beside the shaped reward the trainer reports)."""
    return [k for k in ev.metrics if k in ANSWER_METRICS or k.startswith(ANSWER_METRIC_PREFIX)]


def answer_metrics_across(latest: list[ProducerStats]) -> dict[str, float]:
    """Each answer metric's mean over the producers that report it, weighted by their span's samples."""
    sums: dict[str, list[float]] = {}
    for ev in latest:
        weight = float(ev.metrics.get("producer/samples", 1.0))
        for name in answer_metric_names(ev):
            total = sums.setdefault(name, [0.0, 0.0])
            total[0] += weight * float(ev.metrics[name])
            total[1] += weight
    return {name: s / w for name, (s, w) in sums.items() if w > 0}


def window_gen_s(ev: ProducerStats) -> float:
    """A window's generation seconds: its WINDOW_GEN_S, else (a window of an older log) tokens /
    gen_tokens_per_s, which is what the producer divided (0 when the rate is 0)."""
    if WINDOW_GEN_S in ev.metrics:
        return float(ev.metrics[WINDOW_GEN_S])
    return ev.tokens / ev.gen_tokens_per_s if ev.gen_tokens_per_s > 0 else 0.0


def merged_idle_ratio(windows: list[ProducerStats]) -> float:
    """Idle seconds / window seconds over the windows (capped at 1); a window without WINDOW_IDLE_S has
    idle_ratio × its seconds. When some window lacks WINDOW_S (an older log) the plain mean of the
    windows' idle_ratio."""
    if not all(WINDOW_S in w.metrics for w in windows):
        return math.fsum(w.idle_ratio for w in windows) / len(windows)
    total = math.fsum(float(w.metrics[WINDOW_S]) for w in windows)
    idle = math.fsum(float(w.metrics.get(WINDOW_IDLE_S, w.idle_ratio * w.metrics[WINDOW_S])) for w in windows)
    return min(1.0, idle / total) if total > 0 else math.fsum(w.idle_ratio for w in windows) / len(windows)


def merged_answer_metrics(windows: list[ProducerStats]) -> dict[str, float]:
    """Each answer metric's mean over the windows that report it, weighted by their samples (a plain mean
    when none of them has a sample)."""
    sums: dict[str, list[float]] = {}
    for w in windows:
        for name in answer_metric_names(w):
            total = sums.setdefault(name, [0.0, 0.0, 0.0, 0.0])  # weighted sum, weights, plain sum, count
            value = float(w.metrics[name])
            total[0] += w.samples * value
            total[1] += w.samples
            total[2] += value
            total[3] += 1
    return {name: ws / w if w > 0 else s / n for name, (ws, w, s, n) in sums.items()}


def merge_windows(windows: list[ProducerStats]) -> ProducerStats:
    """One producer's stats windows (in log order) as one window: samples and tokens add, gen_tokens_per_s
    is tokens / generation seconds (`window_gen_s`), idle_ratio idle / window seconds (`merged_idle_ratio`),
    the answer metrics are weighted by samples, param_version and the swap check's figures are the newest
    window's (the newest that carries a check). A single window is returned as it is."""
    if len(windows) == 1:
        return windows[0]
    newest = windows[-1]
    samples = sum(w.samples for w in windows)
    tokens = sum(w.tokens for w in windows)
    gen_s = math.fsum(window_gen_s(w) for w in windows)
    metrics: dict[str, float] = {
        "producer/samples": float(samples),
        WINDOW_GEN_S: gen_s,
        **merged_answer_metrics(windows),
    }
    if all(WINDOW_S in w.metrics for w in windows):
        metrics[WINDOW_S] = math.fsum(float(w.metrics[WINDOW_S]) for w in windows)
    checked = [w for w in windows if any(name in w.metrics for name in SWAP_CHECK_METRICS)]
    if checked:
        check = checked[-1].metrics
        metrics.update({name: check[name] for name in SWAP_CHECK_METRICS if name in check})
    return ProducerStats(
        producer=newest.producer,
        param_version=newest.param_version,
        samples=samples,
        tokens=tokens,
        gen_tokens_per_s=tokens / gen_s if gen_s > 0 else 0.0,
        idle_ratio=merged_idle_ratio(windows),
        versions_in_use=sorted({v for w in windows for v in w.versions_in_use}),
        metrics=metrics,
        created_at=newest.created_at,
    )


def producer_metrics(windows: list[ProducerStats]) -> dict[str, float]:
    """Metrics of the given stats windows (one per producer: `merge_windows` of its span), with totals
    across producers."""
    out: dict[str, float] = {}
    for ev in windows:
        prefix = f"producer/{ev.producer}/"
        out[prefix + "samples"] = float(ev.samples)
        out[prefix + "tokens"] = float(ev.tokens)
        out[prefix + "gen_tokens_per_s"] = float(ev.gen_tokens_per_s)
        out[prefix + "idle_ratio"] = float(ev.idle_ratio)
        out[prefix + "param_version"] = float(ev.param_version)
        for name in [*(n for n in SWAP_CHECK_METRICS if n in ev.metrics), *answer_metric_names(ev)]:
            out[prefix + name.removeprefix("producer/")] = float(ev.metrics[name])
    out.update(answer_metrics_across(windows))
    out.update(tool_ratios(out, ANSWER_METRIC_PREFIX))  # with a tool: accuracy with/without a call, …
    checked = [ev.metrics for ev in windows if SWAP_CHECK_DIFF in ev.metrics]
    if checked:  # the worst producer's newest check, and the oldest version checked
        out[SWAP_CHECK_DIFF] = max(float(m[SWAP_CHECK_DIFF]) for m in checked)
        out[SWAP_CHECK_VERSION] = min(float(m.get(SWAP_CHECK_VERSION, -1.0)) for m in checked)
    if windows:
        out["producer/total_samples"] = float(sum(ev.samples for ev in windows))
        out["producer/gen_tokens_per_s"] = math.fsum(ev.gen_tokens_per_s for ev in windows)
        out["producer/idle_ratio"] = math.fsum(ev.idle_ratio for ev in windows) / len(windows)
    return out
