"""Score draft models on the target's own answers (a `specdraft distill` file): the held-out
figures `train draft` and `fit --drafter draft` log (α at T = 1, greedy agreement, CE, and
the engine-exact greedy τ of the walk at γ = 1..G), so drafts trained by different runs
compare on the same answers (e.g. MT-Bench's or HumanEval's, not only ShareGPT's held-out).
For each γ of --table-gammas it adds the paper's table cells: block efficiency greedy (the
walk) and at T = 1 (the i.i.d. model (1 − α^(γ+1)) / (1 − α)), and the memory-bound
speed-up τ / (1 + γ·N_draft/N_target) of each.

    .venv/bin/python scripts/score_draft.py --data runs/mtbench-answers.jsonl --gamma 5 \
        draft:default draft:runs/losses/tvd/final

Prints one JSON line per draft.
"""

import argparse
import json
from types import SimpleNamespace

from specdraft.bench.metrics import mbsu
from specdraft.drafters.draft_folder import load_draft_folder, shared_parameters
from specdraft.drafters.registry import checkpoint_path
from specdraft.models import load_target, parameter_count
from specdraft.train.common import make_accelerator
from specdraft.train.draft.data import eval_examples_from
from specdraft.train.draft.evaluate import Evaluator
from specdraft.train.losses import iid_block_efficiency


def table_cells(fields: dict, gamma: int, n_draft: int, n_target: int) -> dict:
    """The paper's table at one γ: τ greedy (engine-exact walk) and T = 1 (i.i.d. from α), MBSU of each."""
    greedy = fields[f"eval_tau_walk_g{gamma}"]
    sampled = iid_block_efficiency(fields["eval_accept"], gamma)
    return {f"g{gamma}_tau_greedy": greedy, f"g{gamma}_mbsu_greedy": round(mbsu(greedy, gamma, n_draft, n_target), 4),
            f"g{gamma}_tau_t1": round(sampled, 4), f"g{gamma}_mbsu_t1": round(mbsu(sampled, gamma, n_draft, n_target), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafts", nargs="+", help="draft:PATH ('draft:default': the shipped one)")
    parser.add_argument("--data", required=True, help="a distill file of the target's answers")
    parser.add_argument("--limit", type=int, default=10**9, help="first N answers (default: all)")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--table-gammas", default="3,5", help="γ values of the paper's table (each ≤ --gamma)")
    parser.add_argument("--target", default="default")
    args = parser.parse_args()
    gammas = [int(g) for g in args.table_gammas.split(",") if g]
    if any(not 1 <= g <= args.gamma for g in gammas):
        parser.error(f"--table-gammas must lie in 1..--gamma ({args.gamma})")
    target = load_target(args.target, dtype="auto")
    options = SimpleNamespace(eval_examples=args.limit, seq_len=1024, heldout_fraction=None)
    examples = eval_examples_from(args.data, options, target)
    accelerator = make_accelerator(cpu=True)
    n_target = parameter_count(target.model)
    for spec in args.drafts:
        kind, _, path = spec.partition(":")
        draft, _, _, vocab = load_draft_folder(checkpoint_path(kind, path), target, target.dtype)
        evaluator = Evaluator(examples, target, batch_size=8, chunk=1024, gamma=args.gamma,
                              target_parameters=n_target, vocab=vocab)
        fields = evaluator(accelerator, draft)
        n_draft = parameter_count(draft) - shared_parameters(draft)
        for gamma in gammas:
            fields.update(table_cells(fields, gamma, n_draft, n_target))
        print(json.dumps({"draft": spec, "answers": len(examples), "draft_parameters": n_draft, **fields}), flush=True)


if __name__ == "__main__":
    main()
