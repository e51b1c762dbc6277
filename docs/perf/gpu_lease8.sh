#!/usr/bin/env bash
# One call on a GPU machine (docs/performance.md, "GPUs: GPT-2 small on one H200"): the Pallas kernels
# (jaxdp/models/kernels.py) and the fp8 products (jaxdp/models/fp8.py) alone against XLA's, then the
# command line at batch 16 on text (the Python standard library's bytes as token ids in GPT-2's
# vocabulary), 200 steps each: bf16 through XLA, bf16 through the Pallas kernels, fp8; then bf16
# again, warm from the compilation cache (start-up). Run from the repository root on the lent
# machine; everything comes back under $OUT. GPU_SMALL=1: a tiny GPT (a check of the script on a CPU).
export PYTHONPATH=. PYTHONUNBUFFERED=1; D=${OUT:-/tmp/lease8}; mkdir -p "$D"; W=/tmp/w8; rm -rf $W; mkdir -p $W
export JAXDP_COMPILE_CACHE=$W/cache
LOG=$D/log.txt
python - <<'PY' 2>&1 | tee -a "$LOG"
import importlib.metadata as m, jax
print({p: m.version(p) for p in ("jax", "jaxlib", "flax", "optax")}, jax.devices())
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
SHAPE=(--vocab-size 50304 --seq-len 1024 --layers 12 --d-model 768 --heads 12); K=(); STEPS=${STEPS:-200}
[[ -n "${GPU_SMALL:-}" ]] && SHAPE=(--vocab-size 512 --seq-len 64 --layers 2 --d-model 64 --heads 2) \
  && K=(--tokens 512 --width 64 --vocab 512 --repeats 2) && STEPS=20
echo "=== kernels ($(date +%T))" | tee -a "$LOG"
timeout ${KERNELS_S:-100} python docs/perf/gpu_tools.py kernels "${K[@]}" --json "$D/kernels.json" 2>&1 | tail -14 | tee -a "$LOG"
python -c "
import glob, sysconfig, numpy as np
b = b''.join(open(f, 'rb').read() for f in sorted(glob.glob(sysconfig.get_paths()['stdlib'] + '/*.py')))
np.frombuffer(b, np.uint8).astype(np.uint16).tofile('$W/text.bin'); print('text bytes', len(b))" 2>&1 | tee -a "$LOG"
GPT=(--model gpt --dataset $W/text.bin "${SHAPE[@]}" --optimizer adamw --lr 3e-4 --log-every 50 --no-progress
     --eval-batches 16 --devices 1 --batch-size ${BATCH:-16} --seed 0)
# the Pallas variant only where its kernels alone beat XLA's (LayerNorm and the loss together)
FASTER=$(python -c "
import json; c = json.load(open('$D/kernels.json'))['cases']; ms = lambda k: c.get(k, {}).get('ms', 1e9)
print(int(ms('layer_norm pallas') + ms('cross_entropy pallas') < ms('layer_norm xla') + ms('cross_entropy xla')))" 2>/dev/null)
echo "pallas faster alone: ${FASTER:-no kernels.json}" | tee -a "$LOG"
for v in ${VARIANTS:-bf16:xla bf16:pallas fp8:xla}; do
  p=${v%:*}; k=${v#*:}
  [[ $k == pallas && "$FASTER" != 1 && -z "${VARIANTS:-}" ]] && continue
  echo "=== cli $p $k ($(date +%T))" | tee -a "$LOG"
  timeout ${CLI_S:-130} python -m jaxdp.train "${GPT[@]}" --steps $STEPS --precision $p --kernels $k \
    --metrics-file "$D/b${BATCH:-16}-$p-$k.jsonl" 2>&1 | tail -2 | cut -c1-400 | tee -a "$LOG"
done
echo "=== cli warm ($(date +%T))" | tee -a "$LOG"
timeout 45 python -m jaxdp.train "${GPT[@]}" --steps 20 --precision bf16 --kernels xla --metrics-file "$D/warm.jsonl" \
  2>&1 | tail -1 | cut -c1-400 | tee -a "$LOG"
python - "$D" <<'PY' 2>&1 | tee -a "$LOG"
import glob, json, os, sys
for path in sorted(glob.glob(sys.argv[1] + "/*.jsonl")):
    rows = [json.loads(l) for l in open(path)]
    steps = [r for r in rows if r.get("steps_per_sec")]
    last = steps[-1] if steps else {}
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    print(os.path.basename(path), {k: last.get(k) for k in ("step", "steps_per_sec", "tokens_per_sec", "mfu", "loss")},
          "eval", evals[-1:] if evals else None)
PY
