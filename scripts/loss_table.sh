#!/bin/bash
# Issue 13's loss table at scale: the current draft design (target layers 0 and 29, borrowed
# embeddings, draft vocabulary 8192), one run per loss from the same copied init, same data,
# same schedule (150 steps of 8 sequences). The first run fills the hidden cache and writes the
# held-out answers; the others read both. "pretrain" is the no-distillation row: CE on ShareGPT
# text packed in 1024-token sequences, no target. "tvdpp-layer0" is the depth row: TVD++ with
# one copied layer (0) instead of two. Resumable: rerun; a finished run is skipped.
cd "$(dirname "$0")/.."
R=runs/losses
COMMON="--target default --drafter draft --draft-vocab 8192 --data-offset 0 \
  --max-steps 150 --epochs 1 --eval-every 50 --gamma 5 --heldout-prompts 48 --no-progress --save-every 180"
for run in tvdpp pretrain fkl rkl tvd tvdpp-layer0; do
  out=$R/$run
  loss=${run%-layer0}
  layers=0,29; [ $run = tvdpp-layer0 ] && layers=0
  [ -e $out/final ] && continue
  mkdir -p $out
  echo "== $run $(date -u +%H:%M:%S)"
  if [ $run = pretrain ]; then
    .venv/bin/specdraft train draft --stage pretrain --data sharegpt --limit 3000 --copy-layers 0,29 \
      --embeddings target --draft-vocab 8192 --eval-data $R/tvdpp/heldout.jsonl --eval-examples 48 --gamma 5 \
      --max-steps 150 --epochs 1 --eval-every 50 --batch-size 8 --seq-len 1024 --lr 3e-4 --warmup 0.05 \
      --save-every 25 --resume --no-progress --out $out || exit $?
    continue
  fi
  held=""
  if [ $run != tvdpp ]; then
    [ -e $out/hidden-cache ] || ln -s ../tvdpp/hidden-cache $out/hidden-cache
    held="--heldout-data $R/tvdpp/heldout.jsonl"
  fi
  .venv/bin/specdraft fit $COMMON --copy-layers $layers --loss $loss --out $out $held || exit $?
done
echo "== done $(date -u +%H:%M:%S)"
