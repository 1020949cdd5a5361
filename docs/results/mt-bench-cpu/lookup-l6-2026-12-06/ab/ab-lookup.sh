#!/usr/bin/env bash
# A/B/A/B: auto with lookup at its default 1x4 (no lookup.json) and at 1x6 (lookup.json), 16 MT-Bench turns each.
cd /work/main
for round in 1 2; do
  for shape in 4 6; do
    if [ $shape = 6 ]; then echo '{"beam_width": 1, "beam_length": 6}' > ~/.cache/specdraft/lookup.json; else rm -f ~/.cache/specdraft/lookup.json; fi
    .venv/bin/specdraft bench --target default --dataset mt-bench --limit 16 --max-new-tokens 256 --interleave \
      --drafters auto --out runs/ab-lookup/r$round-l$shape --no-progress > runs/ab-lookup/r$round-l$shape.log 2>&1
  done
done
rm -f ~/.cache/specdraft/lookup.json
