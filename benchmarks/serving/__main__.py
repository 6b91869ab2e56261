"""`python -m benchmarks.serving ...` in the checkout's root: `prefixserve bench compare ...`."""

import sys

from benchmarks.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
