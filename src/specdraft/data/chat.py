"""Rendering conversations with the target's chat template, and assistant-only loss masks.

``encode_conversation`` returns the token ids of a whole conversation, exactly as
``tokenizer.apply_chat_template(messages, tokenize=True)`` gives them, and ``labels``
equal to the ids on the tokens the *assistant* produced and -100 everywhere else (system
and user text, the template's role headers, the text after an end-of-turn token).

How the assistant tokens are found, for any template: the conversation is rendered
incrementally. For the k-th message, an assistant one, the text of messages[:k] with the
generation prompt (``add_generation_prompt=True``: what the model sees before it starts
answering) must be a prefix of the text of messages[:k+1], itself a prefix of the whole
conversation's text; the characters between the two are the assistant's, and so are the
tokens overlapping them (from the fast tokenizer's offsets). Within such a span, tokens
after the first end-of-sequence token (e.g. the newline the template writes after
``<|im_end|>``) are not the model's output and are masked. A template that rewrites
earlier turns (so the prefix property fails) raises a clear error rather than guess.

Tokenizers without a chat template (base models, the tests' tiny tokenizer) use
``PLAIN_TEMPLATE``, a minimal "role: content" format, through the same code path.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..errors import SpecdraftError

IGNORE = -100

# Used when the tokenizer has none: "role: content" lines, an EOS after each assistant
# turn (so the model learns to stop), and "assistant:" as the generation prompt. (The
# newline is an expression: transformers renders templates with trim_blocks, which eats a
# literal newline after a block tag.)
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %} {{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass
class Encoded:
    """input_ids: (T,) token ids; labels: (T,) = input_ids on assistant tokens, else -100."""

    input_ids: list[int]
    labels: list[int]

    @property
    def num_assistant_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE)


def template_of(tokenizer) -> str:
    """The tokenizer's chat template, or ``PLAIN_TEMPLATE`` if it has none."""
    return getattr(tokenizer, "chat_template", None) or PLAIN_TEMPLATE


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation's text through the chat template (no tokenisation)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=template_of(tokenizer))
    except Exception as e:  # jinja raises its own errors, e.g. a template enforcing alternation
        raise SpecdraftError(f"the chat template failed on a conversation: {type(e).__name__}: {e}") from None


def tokenize(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of rendered text. No special tokens are added:
    the template already wrote them (what ``apply_chat_template(tokenize=True)`` does)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise SpecdraftError("assistant-only masks need a fast tokenizer (character offsets)") from None
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` followed by the generation prompt: the input from which
    the model writes the next assistant turn."""
    return tokenize(tokenizer, render(tokenizer, messages, add_generation_prompt=True))[0]


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's text and the character spans [start, end) written by the
    assistant (one per assistant message, template end-of-turn text included)."""
    full = render(tokenizer, messages)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:k], add_generation_prompt=True)
        through = render(tokenizer, messages[: k + 1])
        if not (through.startswith(before) and full.startswith(through)):
            raise SpecdraftError("the chat template does not render conversations incrementally (an earlier "
                                 "turn changes when later turns are added), so assistant tokens cannot be located")
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return full, spans


def encode_conversation(tokenizer, messages: list[dict], max_length: int | None = None,
                        eos_ids: set[int] | None = None, require_assistant: bool = True) -> Encoded | None:
    """Token ids and assistant-only labels of a conversation, truncated to its first
    ``max_length`` tokens; None if no assistant token is left (unless not
    ``require_assistant``: then all labels are -100).

    eos_ids: tokens that end a turn (default: the tokenizer's EOS); tokens after the first
    of them inside an assistant span are masked, since the model stops there.
    """
    text, spans = assistant_spans(tokenizer, messages)
    ids, offsets = tokenize(tokenizer, text)
    if eos_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = {int(eos)} if eos is not None else set()
    labels = [IGNORE] * len(ids)
    starts = [s for s, _ in spans]
    ended: set[int] = set()  # spans whose EOS has been seen
    for i, ((a, b), tok) in enumerate(zip(offsets, ids)):
        k = bisect.bisect_right(starts, max(b, a + 1) - 1) - 1  # last span starting before the token ends
        if k < 0 or a >= spans[k][1] or k in ended:
            continue
        labels[i] = tok
        if tok in eos_ids:
            ended.add(k)
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    encoded = Encoded(input_ids=ids, labels=labels)
    return encoded if encoded.num_assistant_tokens or not require_assistant else None
