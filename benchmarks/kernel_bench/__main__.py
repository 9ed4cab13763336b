"""`python -m benchmarks.kernel_bench [--check] [--only K..] [--sweep [K..]] [--engine] [--json F]`."""

import sys

from benchmarks.kernel_bench.cli import main

sys.exit(main())
