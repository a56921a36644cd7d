"""`python -m minillm.check`: check or grade exercise files (minillm/check/__init__.py)."""

import sys

from minillm.check import main

sys.exit(main())
