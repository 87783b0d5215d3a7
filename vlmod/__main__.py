"""`python -m vlmod`: the `vlmod` command, for when the console script is not on PATH."""

import sys

from vlmod.cli import main

sys.exit(main())
