"""``python -m benchmarks BENCH ...``: the same as ``omnirelay bench BENCH ...``."""

import sys

from benchmarks.cli import main

sys.exit(main())
