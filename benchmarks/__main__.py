"""`python -m benchmarks`: the development benchmarks (see `__init__`)."""

import sys

from benchmarks.command import main

if __name__ == "__main__":
    sys.exit(main())
