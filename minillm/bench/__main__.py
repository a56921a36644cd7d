"""`python -m minillm.bench`: the benchmark's command line (minillm/bench/cli.py)."""

import sys

from minillm.bench.cli import main

sys.exit(main())
