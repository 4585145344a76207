"""Bus benchmark: our publish/read/decode/ack path vs raw redis-py, and our codec vs pickle (see rollstream.bench.bus)."""

import sys

from rollstream.bench.bus import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
