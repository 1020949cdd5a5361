"""Incremental detokenization for streamed responses: ``specdraft.textstream`` (one
implementation shared with ``engine.stream``), re-exported for the server."""

from ..textstream import TextStream

__all__ = ["TextStream"]
