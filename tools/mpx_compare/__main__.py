"""``python -m mpx_compare ARGS``: the same as ``mpx compare ARGS``."""

import sys

from mpx.cli import main

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
