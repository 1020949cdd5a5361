"""``python -m specdraft``: the same command line as the ``specdraft`` script."""

from .cli import console

if __name__ == "__main__":
    console()
