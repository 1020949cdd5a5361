"""``python -m specdraft``: the same command line as the ``specdraft`` script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
