"""`python -m prefixserve.bench compare|run|report ...`."""

import sys

from prefixserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
