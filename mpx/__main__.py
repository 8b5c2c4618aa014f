"""``python -m mpx`` runs the command line."""

import sys

from mpx.cli import main

sys.exit(main())
