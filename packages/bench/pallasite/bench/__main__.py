"""`python -m pallasite.bench`: the main job (see cli.py)."""

import sys

from pallasite.bench.cli import main

sys.exit(main())
