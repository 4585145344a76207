"""Generation benchmark: tokens/s of one producer with the config's policy (see producers.bench)."""

import sys

from producers.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
