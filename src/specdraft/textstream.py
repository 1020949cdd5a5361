"""Incremental detokenization for streamed text (``engine.stream``, the CLI, the server).

Invariant: the concatenation of every delta ``TextStream`` returns is a prefix of the
final text at every moment, and equals ``GenerationResult.text`` once the result has
been pushed. Two things could break that and are held back until resolved:

* an incomplete UTF-8 sequence at the end (the tokenizer shows it as U+FFFD) — its next
  token completes it;
* a tail that could be the start of a stop string — the engine cuts the text before a
  stop string, so text that turns out to begin one must never have been sent.
"""

from __future__ import annotations

from .rows import GenerationResult


class TextStream:
    """Text deltas of one request from its token events."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.shown = ""

    def push(self, new_ids: list[int], result: GenerationResult | None = None) -> str:
        """The text that became final with ``new_ids`` (all that is left once ``result`` is given)."""
        self.ids.extend(new_ids)
        if result is not None:
            stable = result.text
        else:
            # A full decode each time: cheap for the lengths served, and unlike decoding a
            # window it cannot disagree with the final decode of the whole sequence.
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
            stable = text[: len(text) - self._stop_prefix_len(text)]
        if len(stable) <= len(self.shown) or not stable.startswith(self.shown):
            return ""
        delta, self.shown = stable[len(self.shown):], stable
        return delta

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
