"""Aggregator fold benchmark: pure fold and the worker through Redis (see consumers.aggregator.bench)."""

import sys

from consumers.aggregator.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
