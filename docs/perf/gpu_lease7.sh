#!/usr/bin/env bash
# One call on a GPU machine (docs/performance.md, its Muon row): --optimizer muon with its
# Newton-Schulz batched by matrix shape (jaxdp/step/optim.py, batched_muon) against optax.contrib.muon's one per
# parameter: the update alone (gpu_tools.py muon), then the command line at batch 16, AdamW, jaxdp's
# Muon and optax's Muon (the latter by swapping jaxdp.step.optim.batched_muon for optax's in the process).
# Run from the repository root on the lent machine; everything comes back under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1; D=$OUT; R=/tmp/res; rm -rf $R; mkdir -p $R
OUT=$R/update WORK=/tmp/w1 GPU_STAGES=muon-update GPU_DEADLINE=${D1:-120} bash docs/perf/gpu_run.sh > $R/update.out 2>&1
grep -E "^(adamw|muon|optax-muon) " $R/update.out
W=/tmp/w2; OUT=$R/cli WORK=$W GPU_STAGES=muon GPU_DEADLINE=${D2:-250} bash docs/perf/gpu_run.sh > $R/cli.out 2>&1
tail -4 $R/cli.out | head -3
# the same command line with optax's own muon (one Newton-Schulz per parameter), in the same cache
SHAPE="--vocab-size 50304 --seq-len 1024 --layers 12 --d-model 768 --heads 12 --batch-size 16"
[[ -n "${GPU_SMALL:-}" ]] && SHAPE="--vocab-size 512 --seq-len 64 --layers 2 --d-model 64 --heads 2 --batch-size 4"
timeout 150 python - "$W" $SHAPE > $R/optax-cli.out 2>&1 <<'PY'
import sys, optax
import jaxdp.step.optim as m
m.batched_muon = lambda lr, adam_learning_rate=None, dimension_numbers=None: optax.contrib.muon(
    lr, adam_learning_rate=adam_learning_rate, muon_weight_dimension_numbers=dimension_numbers)
from jaxdp.train import main
w, shape = sys.argv[1], sys.argv[2:]
sys.argv = ["jaxdp.train", "--model", "gpt", "--dataset", f"{w}/tokens.bin", *shape, "--precision", "bf16",
            "--optimizer", "muon", "--lr", "3e-4", "--log-every", "20", "--no-progress", "--eval-batches", "1",
            "--devices", "1", "--steps", "60", "--metrics-file", f"{w}/b16-muon-optax.jsonl"]
main()
PY
tail -2 $R/optax-cli.out
python - $W <<'PY'
import json, sys
for run in ("b16-adamw", "b16-muon", "b16-muon-optax"):
    try:
        rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{run}.jsonl")]
    except OSError:
        print(run, "no metrics"); continue
    steps = [r for r in rows if "event" not in r and r.get("steps_per_sec")]
    print(run, [(r["step"], round(1000 / r["steps_per_sec"], 2), r.get("mfu"), r.get("loss")) for r in steps])
PY
cp $W/*.jsonl $R/ 2>/dev/null; tar czf $D/lease7.tgz -C $R .; ls -la $D
