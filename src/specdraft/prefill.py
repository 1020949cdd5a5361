"""Prefill, the loop's first stage: a batch's prompts through the target into a new cache.

Rows of ragged prompts run right-padded in one pass, or in groups of similar length when
one pass would waste too much on padding (``prefill_groups``). What the loop needs from it
is each row's hidden state at its prompt's last token (whose logits choose the first new
token) and the one before it (drafters with a context window keep both).
"""

from __future__ import annotations

import torch

from .cache import CompactCache
from .models import Target

PREFILL_PADDING = 1.25  # a prefill group may run at most this many times its real tokens


def prefill_groups(lengths: list[int], padding: float = PREFILL_PADDING) -> list[list[int]]:
    """Split rows into groups of similar prompt length, each run as one padded pass.

    Rows are taken shortest first; a row joins the current group while the group's padded
    size (rows x longest) stays within ``padding`` x its real tokens. Returns lists of row
    indices covering every row once (one group when lengths are close)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= padding * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups if len(groups) > 1 else [list(range(len(lengths)))]  # one group: keep the order


def prefill(target: Target, prompts: list[list[int]], capacity: int,
            feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None, CompactCache]:
    """Run the prompts; return (B, 2, d) hidden states at each prompt's last two tokens
    (the last one's logits choose the first token; a one-token prompt repeats it), the
    ``feature_layers`` states there (B, 2, n, d) or None, and the cache holding them (rows in
    ``prompts`` order, ``capacity`` slots).

    Prompts of very different lengths are run in groups of similar length (see
    ``prefill_groups``): one padded pass would cost max length x B tokens."""
    device = target.device
    groups = prefill_groups([len(p) for p in prompts])
    hidden, features, caches = [], [], []
    for group in groups:
        cache = CompactCache(target.num_layers, len(group), capacity, device).allocate(
            *target.kv_shape, target.dtype)  # a compiled target then meets one kind of cache
        found = prefill_padded(target, [prompts[i] for i in group], cache, feature_layers)
        hidden.append(found[0])
        features.append(found[1])
        caches.append(cache)
    cache = caches[0]
    for other in caches[1:]:
        cache.extend(other)
    if len(groups) == 1:
        return hidden[0], features[0], cache
    order = torch.tensor([i for group in groups for i in group], device=device)
    back = torch.argsort(order)  # row i sits at position back[i] of the grouped order
    cache.select_rows(back)
    return torch.cat(hidden)[back], None if features[0] is None else torch.cat(features)[back], cache


def prefill_padded(target: Target, prompts: list[list[int]], cache: CompactCache,
                   feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the right-padded prompts in one pass into ``cache``; return (B, 2, d) hidden
    states at each prompt's last two tokens, and the feature-layer states there (B, 2, n, d)
    or None."""
    device = target.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    P = int(lengths.max())
    tokens = torch.zeros(len(prompts), P, dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = torch.tensor(prompt, device=device)
    pos = torch.arange(P, device=device)
    causal = pos[None, :, None] >= pos[None, None, :]
    real = pos[None, :] < lengths[:, None]
    # Padding queries see only themselves so that no attention row is empty.
    mask = (causal & real[:, None, :]) | (torch.eye(P, dtype=torch.bool, device=device) & ~real[:, :, None])
    positions = pos[None].expand(len(prompts), -1)
    hidden, features = target.forward_features(tokens, positions, mask[:, None], cache, feature_layers)
    cache.commit(positions, lengths)
    last = (lengths[:, None] + torch.arange(-2, 0, device=device)).clamp(min=0)
    every = torch.arange(len(prompts), device=device)[:, None]
    return hidden[every, last], None if features is None else features[every, last]
