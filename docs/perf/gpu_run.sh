#!/usr/bin/env bash
# The GPU figures in docs/performance.md ("One GPU"), measured in one run on one GPU. Run from the
# repository root, with the project importable (PYTHONPATH=. on a machine whose JAX is
# preinstalled); results go to $OUT (default: docs/perf/gpu).
#   bash docs/perf/gpu_run.sh
set -uo pipefail
OUT=${OUT:-docs/perf/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAXDP_COMPILE_CACHE=/tmp/jaxdp-gpu-cache
python - <<'PY' | tee "$OUT/versions.txt"
import importlib.metadata as m, jax
for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "torch", "numpy"):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, "-")
print(jax.devices())
PY
# A token file of GPT-2's vocabulary size for the CLI (random ids: speed only).
python -c "import numpy as np; np.random.default_rng(0).integers(0, 50304, 8_000_000, dtype=np.uint16).tofile('/tmp/tokens.bin')"

# Steps 1 and 2 can run alone: GPU_RUN_STEPS="2" skips the torch comparison.
# 1. The model step alone, jaxdp against PyTorch at batch 16 and 32 (bench gpt --vs-torch).
[[ "${GPU_RUN_STEPS:-1 2}" == *1* ]] && python -m jaxdp.bench gpt --vs-torch --batch-sizes 16,32 --steps 20 --repeats 5 --json "$OUT/gpt-vs-torch.json" 2>&1 | tail -8

# 2. The CLI: steady step with and without prefetch, then start-up with a cold and a warm cache.
GPT2=(--model gpt --dataset /tmp/tokens.bin --vocab-size 50304 --seq-len 1024 --layers 12 --d-model 768
      --heads 12 --batch-size 16 --precision bf16 --optimizer adamw --lr 3e-4 --steps 150 --log-every 50
      --no-progress --eval-batches 2)
[[ "${GPU_RUN_STEPS:-1 2}" == *2* ]] || exit 0
rm -rf /tmp/jaxdp-gpu-cache
for run in cold warm; do
  python -m jaxdp.train "${GPT2[@]}" --prefetch 2 --metrics-file "$OUT/cli-$run.jsonl" 2>&1 | tail -2
done
python -m jaxdp.train "${GPT2[@]}" --prefetch 0 --metrics-file "$OUT/cli-noprefetch.jsonl" 2>&1 | tail -2
python -m jaxdp.train "${GPT2[@]}" --attention xla --metrics-file "$OUT/cli-xla.jsonl" 2>&1 | tail -2
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for run in ("cold", "warm", "noprefetch", "xla"):
    rows = [json.loads(l) for l in open(f"{out}/cli-{run}.jsonl")]
    steps = [r for r in rows if "event" not in r and r["steps_per_sec"]]
    done = rows[-1]
    print(f"cli {run}: steady step {1000 / steps[-1]['steps_per_sec']:.1f} ms, tokens/s {steps[-1]['tokens_per_sec']:.0f}, "
          f"mfu {steps[-1].get('mfu')}, start-up {done['startup_s']:.1f} s, first step {done['compile_s']:.1f} s, "
          f"cache hits {done['compile_cache_hits']}")
PY
