#!/bin/bash
# Issue 13: on-policy (the draft's own continuations) against off-policy (the conversations)
# fine-tuning of the shipped draft, equal steps. Usage: run.sh a|b
cd /work/main
COMMON="--target default --drafter draft --init-from default --data-offset 5600 --max-steps 120 --epochs 1 \
  --eval-every 40 --gamma 3 --lr 1e-4 --warmup 0.05 --heldout-data runs/fit-own4/heldout.jsonl --no-progress"
case $1 in
  a) exec .venv/bin/specdraft fit $COMMON --on-policy --out runs/onpol/a ;;
  b) exec .venv/bin/specdraft fit $COMMON --out runs/onpol/b ;;
esac
