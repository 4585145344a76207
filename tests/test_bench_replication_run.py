"""`rollstream bench replication_run` (issue 42 item 3, what WAIT costs a whole run): its arguments, and its
figures and ratios on made-up logs. The benchmark itself (~10 minutes of runs) is not run here."""

from __future__ import annotations

import math

import pytest

from benchmarks.replication_run import CONFIGS, RunFigures, figures, format_report, parse_args, summarize
from rollstream.config import load_config


def test_arguments_and_the_three_configurations() -> None:
    args = parse_args(["--rounds", "2", "--window-s", "50", "--configs", "0,2", "trainer.seed=3"])
    assert (args.rounds, args.window_s, args.configs) == (2, 50.0, ["0", "2"])
    assert args.config.endswith("pipeline.yaml") and args.overrides == ["trainer.seed=3"]
    defaults = parse_args([])
    assert (defaults.rounds, defaults.window_s, defaults.configs) == (3, 45.0, ["0", "1", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--configs", "0,3"])
    for name, overrides in CONFIGS.items():  # each configuration is a valid run config
        redis = load_config(None, overrides).run.redis
        assert (redis.replicas, redis.acks_needed()) == (int(name), int(name))


def test_figures_use_only_whole_step_cycles_inside_the_window() -> None:
    # params v3..v6 inside the window at 1000, 1100, 1300, 1400 ms; step_end of 4..6 (and 3, not counted)
    params = {3: 1000, 4: 1100, 5: 1300, 6: 1400}
    step_ends = {3: (4, 0.05, 0.01), 4: (4, 0.06, 0.02), 5: (2, 0.08, 0.01), 6: (4, 0.07, 0.03)}
    fig = figures("1", 1, params, step_ends)
    assert (fig.steps, fig.samples, fig.span_s) == (3, 10, 0.4)
    assert fig.samples_per_s == pytest.approx(25.0)
    assert fig.cycle_ms == 100.0  # median of 100, 200, 100
    assert fig.step_ms == pytest.approx(70.0) and fig.gen_ms == pytest.approx(20.0)
    with pytest.raises(ValueError, match="no two consecutive"):
        figures("0", 1, {3: 1000, 5: 1200}, step_ends)


def test_summary_is_the_median_over_rounds_and_ratios_are_per_round() -> None:
    def run(config: str, rnd: int, sps: float, cycle: float) -> RunFigures:
        return RunFigures(config, rnd, 100, int(sps * 10), 10.0, sps, cycle, cycle * 0.8, 5.0)

    runs = [run("0", 1, 100, 50), run("1", 1, 80, 62.5), run("2", 1, 50, 100),
            run("0", 2, 50, 100), run("1", 2, 45, 110), run("2", 2, 40, 125),
            run("0", 3, 60, 80), run("1", 3, 30, 160), run("2", 3, 30, 150)]
    s = summarize(runs)
    assert s["0"]["samples_per_s"] == 60 and s["0"]["samples_per_s/ratio"] == 1.0
    assert s["1"]["samples_per_s"] == 45 and s["1"]["samples_per_s/ratio"] == pytest.approx(0.8)  # .8 .9 .5
    assert s["2"]["cycle_ms"] == 125 and s["2"]["cycle_ms/ratio"] == pytest.approx(1.875)  # 2 1.25 1.875
    assert s["2"]["gen_ms/ratio"] == 1.0 and s["1"]["rounds"] == 3
    text = format_report(runs, s)
    assert "2 replicas (WAIT 2): samples/s 40.00 (0.50x)" in text
    # a configuration without its round's replicas-0 run has no ratio
    assert math.isnan(summarize([run("1", 1, 80, 62.5)])["1"]["samples_per_s/ratio"])
