"""Async vs sync benchmark: same workload, synchronous alternation vs rollstream's overlap (see rollstream.bench.async_bench)."""

import sys

from rollstream.bench.async_bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
