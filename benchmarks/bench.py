# Runs the rmsnorm benchmark suite from a checkout: `python benchmarks/bench.py --quick`.
"""Thin entry point for :mod:`rmsnorm.bench`; all options are in ``--help``.

Puts the repository root first on ``sys.path`` when the checkout holds a built extension (or
rmsnorm is not importable otherwise), so the in-place build is what gets timed.
"""

import glob
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _use_checkout() -> None:
    built_here = glob.glob(os.path.join(ROOT, "rmsnorm", "_core*"))
    if (built_here or importlib.util.find_spec("rmsnorm") is None) and ROOT not in sys.path:
        sys.path.insert(0, ROOT)


if __name__ == "__main__":
    _use_checkout()
    from rmsnorm.bench import main

    sys.exit(main())
