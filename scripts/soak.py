"""Soak benchmark: the whole pipeline with retention on for a bounded time (see rollstream.bench.soak)."""

import sys

from rollstream.bench.soak import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
