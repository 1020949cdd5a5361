"""Each row's latest target states, for drafters that look back (ReDrafter with context
attention, ``heads.context``).

The engine computes a target state for every token it accepts (in verification, or a
plain step) and keeps the last C of each row here, right-aligned: row b's newest state,
the one whose logits chose g0, sits in the last slot. A window starts at the prompt's
second-to-last token (prefill pushes the last two prompt states), the states a head's
training corpus stores for an answer, so training and inference see the same windows.

    states  (B, C, d)  the target's dtype; slots before the last lengths[b] are stale
    lengths (B,) long  how many trailing slots hold states, at most C

All updates are tensor ops: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RecentStates:
    states: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def start(cls, tail: torch.Tensor, counts: torch.Tensor, window: int) -> "RecentStates":
        """A buffer of ``window`` slots holding tail (B, m, d), of which each row's last
        counts[b] are real."""
        B, m, d = tail.shape
        empty = cls(tail.new_zeros(B, window, d), torch.zeros(B, dtype=torch.long, device=tail.device))
        empty.push(tail, counts, right_aligned=True)
        return empty

    @property
    def window(self) -> int:
        return self.states.shape[1]

    def push(self, new: torch.Tensor, n: torch.Tensor, right_aligned: bool = False) -> None:
        """Append each row's n[b] new states: new (B, m, d), its first n[b] (or, with
        ``right_aligned``, its last n[b]) in order, oldest first."""
        B, m, _ = new.shape
        C = self.window
        joined = torch.cat([self.states, new], dim=1)
        ends = torch.full_like(n, C + m) if right_aligned else C + n  # where each row's newest state sits
        take = ends[:, None] - C + torch.arange(C, device=new.device)  # the C slots ending at each row's last state
        self.states = joined.gather(1, take[:, :, None].expand(-1, -1, joined.shape[-1]))
        self.lengths = (self.lengths + n).clamp(max=C)

    def select(self, keep: torch.Tensor) -> None:
        """Keep the rows ``keep`` (1D long), in that order."""
        self.states, self.lengths = self.states[keep], self.lengths[keep]

    def extend(self, other: "RecentStates") -> None:
        """Append the rows of ``other`` (same window)."""
        self.states = torch.cat([self.states, other.states])
        self.lengths = torch.cat([self.lengths, other.lengths])
