"""Aggregator worker: folds the `metrics` stream into one `records` entry per global step."""

from consumers.aggregator.metrics import MetricsAggregator, aggregation_rule

__all__ = ["MetricsAggregator", "aggregation_rule"]
