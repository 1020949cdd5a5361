"""What one draft token costs against one target step, for drafts made of the target's own
layers (``fit --drafter draft --copy-layers``), on this machine.

Issue 13: on a CPU the speed-up is decided by the draft's wall-clock cost per token, not by
its parameter ratio (a forward pays a fixed per-layer overhead). This times, after a cached
prefix, a one-token forward of the target, and of drafts keeping k of its layers at full
width with an output layer over ``--draft-vocab`` rows (the draft vocabulary), in the
target's dtype; medians of ``--trials``. The draft's shape is the target's, so cutting its
layer list gives exactly the copied-layer draft's compute.

    .venv/bin/python scripts/draft_cost.py --layers 1,2,3,4 --draft-vocab 8192

``--draft FOLDER`` (repeatable) also times a trained draft folder (e.g. the shipped one,
``src/specdraft/assets/smollm2-135m-instruct/draft``) with its whole output layer and with
``--draft-vocab`` of its rows: what a draft vocabulary saves per draft token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def one_token_ms(model, head_rows: int, prefix: int, trials: int) -> float:
    """Median ms of a one-token forward + the output layer's first ``head_rows`` rows + argmax."""
    from transformers import DynamicCache

    ids = torch.randint(0, 1000, (1, prefix), generator=torch.Generator().manual_seed(0))
    weight = model.lm_head.weight[:head_rows]
    times = []
    with torch.inference_mode():
        cache = DynamicCache()
        model.model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = torch.tensor([[5]])
        for _ in range(trials + 3):
            start = time.perf_counter()
            hidden = model.model(input_ids=token, past_key_values=cache, use_cache=True).last_hidden_state
            (hidden[:, -1] @ weight.T).argmax(-1)
            times.append(time.perf_counter() - start)
            cache.crop(-1)  # back to the prefix: every trial sees the same cache length
    return 1000 * statistics.median(times[3:])


def draft_rows(folder: str, target, args, full: float) -> list[dict]:
    """The draft at ``folder``, in the target's dtype, with its whole output layer and with
    ``--draft-vocab`` rows (a row subset costs what the draft vocabulary's rows cost)."""
    from specdraft.drafters.draft_folder import load_draft_folder

    draft = load_draft_folder(folder, target, target.dtype)[0].eval()
    out = []
    for rows in (draft.lm_head.weight.shape[0], args.draft_vocab):
        ms = one_token_ms(draft, rows, args.prefix, args.trials)
        out.append({"draft": folder, "layers": draft.config.num_hidden_layers, "head_rows": rows, "ms": ms,
                    "of_target": ms / full})
    return out


def main() -> None:
    from specdraft.models import load_target

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--layers", default="1,2,3,4", help="draft depths to time")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--draft", action="append", default=[], metavar="FOLDER", help="also time this draft folder")
    args = p.parse_args()
    target = load_target(args.target, dtype=args.dtype)
    model = target.model
    full = one_token_ms(model, model.lm_head.weight.shape[0], args.prefix, args.trials)
    rows = [{"layers": model.config.num_hidden_layers, "head_rows": model.lm_head.weight.shape[0], "ms": full,
             "of_target": 1.0}]
    rows += [row for folder in args.draft for row in draft_rows(folder, target, args, full)]
    layers = model.model.layers
    for k in [int(x) for x in args.layers.split(",")]:
        model.model.layers = torch.nn.ModuleList(layers[:k])
        model.config.num_hidden_layers = k
        ms = one_token_ms(model, args.draft_vocab, args.prefix, args.trials)
        rows.append({"layers": k, "head_rows": args.draft_vocab, "ms": ms, "of_target": ms / full})
    print(json.dumps({"target": target.name, "dtype": str(target.dtype), "threads": torch.get_num_threads(),
                      "prefix": args.prefix, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
