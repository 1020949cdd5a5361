"""Training data: ShareGPT conversations, chat rendering with assistant-only loss masks,
and resumable JSONL dataset files (the ``specdraft distill`` output).

- ``sharegpt``: streaming decode of the (truncated) packaged ShareGPT JSON, role
  normalisation, the deterministic held-out split
- ``chat``: the target's chat template -> token ids + labels (-100 except assistant tokens)
- ``jsonl``: progressive, crash-tolerant JSONL writing and reading
"""

from .chat import IGNORE, PLAIN_TEMPLATE, Encoded, encode_conversation, encode_prompt, render
from .jsonl import JsonlAppender, iter_records, read_records
from .sharegpt import (Conversation, StreamStats, first_turn, iter_conversations, iter_json_array,
                       load_conversations, normalise, sharegpt_path, split_of)

__all__ = ["IGNORE", "PLAIN_TEMPLATE", "Encoded", "encode_conversation", "encode_prompt", "render",
           "JsonlAppender", "iter_records", "read_records", "Conversation", "StreamStats", "first_turn",
           "iter_conversations", "iter_json_array", "load_conversations", "normalise", "sharegpt_path", "split_of"]
