"""`python -m vlmod.cli`: the `vlmod` command (as `python -m vlmod`)."""

import sys

from vlmod.cli import main

sys.exit(main())
