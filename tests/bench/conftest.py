"""Puts the checkout's root on sys.path: the comparison harness (benchmarks/serving/) is not part
of the installed package, and its tests import it as `benchmarks.serving`."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
