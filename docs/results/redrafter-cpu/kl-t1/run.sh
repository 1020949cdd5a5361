#!/bin/bash
# The soft-label lever for sampling: a warm fine-tune of the shipped head with and without
# --kl-weight 1, scored by sum_x min(p, q) on the target's T = 1 answers to MT-Bench.
set -e
cd /work/main
while pgrep -f "runs/t1-sharegpt80" > /dev/null; do sleep 15; done
S=.venv/bin/specdraft
$S distill --data runs/mtbench-prompts.jsonl --temperatures 1 --max-new-tokens 256 --dtype bfloat16 \
  --out runs/mtbench-t1.jsonl --no-progress
.venv/bin/python scripts/score_head.py --heldout-data runs/mtbench-t1.jsonl --corpus-dir runs/score-corpora \
  --sampled 1 redrafter:default > runs/kl-t1/score-shipped.jsonl
COMMON="--target default --drafter redrafter --init-from default --head shared --feature-layers 2,14,26 \
  --draft-vocab 8192 -K 4 --data-offset 8000 --tokens 600k --max-steps 600 --lr 1e-4 --seed 5 \
  --eval-every 200 --heldout-prompts 32 --no-progress"
$S fit $COMMON --out runs/kl-t1/off
mkdir -p runs/kl-t1/on
cp -al runs/kl-t1/off/corpus runs/kl-t1/off/heldout-corpus runs/kl-t1/off/heldout.jsonl runs/kl-t1/off/vocab.json runs/kl-t1/on/
$S fit $COMMON --kl-weight 1 --out runs/kl-t1/on
.venv/bin/python scripts/score_head.py --heldout-data runs/mtbench-t1.jsonl --corpus-dir runs/score-corpora \
  --sampled 1 redrafter:runs/kl-t1/off/final redrafter:runs/kl-t1/on/final > runs/kl-t1/score-fits.jsonl
echo done
