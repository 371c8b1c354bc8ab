"""Same as `ortkv bench` (see python/ortkv/generate/bench.py)."""

import sys

from ortkv.generate.bench import main

if __name__ == "__main__":
    sys.exit(main())
