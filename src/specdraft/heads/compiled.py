"""A ReDrafter head's drafting through torch.compile (``--compile-drafter``, ``ReDrafter.compile``).

At batch 1 an eager head's beam search is ~150 small ops: on the AVX512-BF16 EPYC in bfloat16
its W = 2, L = 3 search took 3.4 ms of a ~38 ms step, of which about half was the linears'
own oneDNN calls and the rest per-op overhead. Compiled, the search is one graph per shape:
the fusion, the recurrence, the blocks, the output layer, log-softmax and top-k in a handful
of kernels, with the weights frozen into the graph and the few-row GEMMs autotuned (inductor's
C++ micro-GEMM beats oneDNN there: 25 against 60 µs for one block's product), as for the
target (``graphs.CPU_INDUCTOR_OPTIONS``). What it measured is in docs/engine.md, "A compiled
ReDrafter head".

Graphs: the search is specialised on (rows B, beams W, length L) — L and W decide how many
depths and beams the loop unrolls — and on standard strides (inputs are cloned to them).
``warm`` compiles every (B, W, L) the engine asks of a warmed-up drafter at batch 1 and 2,
from one real call's inputs; after ``warmed`` a shape not compiled runs eagerly (dynamo's
``eager_on_recompile``) rather than stall a step for seconds. Sampled chains stay eager: their
per-depth logits compiled measured level at T = 1 (the compiled call's own overhead, three
small calls a step, ate what their kernels saved; docs/engine.md).

Exactness does not depend on any of this: beams are candidates the target verifies, and
compiled logits only change which candidates are proposed.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import graphs
from .beam_search import BeamResult, redrafter_beam_search


def standard(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with standard strides: the graphs are specialised on them, and a one-row slice of
    a wider buffer keeps its row stride (``contiguous()`` leaves size-1 dims as they are)."""
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


class CompiledHead:
    """The compiled calls of one ``ReDrafterHead`` (``fuse``: whether it reads feature layers).

    ``search(hidden (B, d), features (B, n, d) or None, g0 (B,), W, L) -> BeamResult`` is
    ``redrafter_beam_search`` from the fused root state."""

    def __init__(self, head, fuse: bool, backend: str = "inductor"):
        self.head, self.fuse = head, fuse
        if head.config.head == "shared" and head.draft_vocab is not None:
            # The target's draft-vocabulary rows as a module: freezing folds a module's weights
            # into the graph, and the parts' own row cache would break it (data pointers).
            head.parts = replace(head.parts, rows_logits=head.parts.module_rows(head.draft_vocab.ids()))
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        self.options: dict = {}
        if backend == "inductor" and head.rnn_w.weight.device.type == "cpu":
            import torch._inductor.config as _inductor_config  # noqa: F401  (``search`` patches it)
            self.options = dict(graphs.CPU_INDUCTOR_OPTIONS)
        # Guards on the head's modules dropped, as for the target: nothing changes them now.
        dynamo = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self._search = torch.compile(self.fused_search, dynamic=False, backend=backend, options=dynamo)
        self.stance = "default"
        self.template: tuple | None = None  # one row of a real call's inputs (``warm``)

    def fused_search(self, hidden, features, g0, W: int, L: int) -> tuple[torch.Tensor, ...]:
        """What is compiled: the feature fusion, then the beam search; ``BeamResult``'s fields."""
        root = self.head.fuse_features(hidden, features) if self.fuse else hidden
        r = redrafter_beam_search(self.head, root, g0, W, L)
        return r.beams, r.valid, r.scores, r.token_logprobs

    def search(self, hidden: torch.Tensor, features: torch.Tensor | None, g0: torch.Tensor,
               W: int, L: int) -> BeamResult:
        hidden, features, g0 = standard(hidden), standard(features), standard(g0)
        if self.template is None:
            self.template = (hidden[:1], None if features is None else features[:1], g0[:1])
        # no_grad: a guard of every graph (the engine's calls run so); the stance (``warmed``) and
        # inductor's config (frozen weights, autotuned GEMMs) only around the head's calls.
        with torch.no_grad(), torch.compiler.set_stance(self.stance), torch._inductor.config.patch(self.options):
            return BeamResult(*self._search(hidden, features, g0, W, L))

    def warm(self, widths: dict[int, int], length: int) -> None:
        """Compile the search for B rows (``widths``: B -> the W drafted at B) at every L from 1
        to ``length``, from the first real call's inputs (none yet: nothing to do). The engine's
        policy and the requests' budgets ask for any L up to the drafter's, so waiting for a
        generation to meet each would leave some to run eager."""
        if self.template is None:
            return
        for rows, W in widths.items():
            inputs = [None if t is None else t.expand(rows, *t.shape[1:]) for t in self.template]
            for L in range(1, length + 1):
                self.search(*inputs, W, L)

    def warmed(self) -> None:
        """From now on a shape not compiled yet runs eager (a compile would stall a step)."""
        self.stance = "eager_on_recompile"
