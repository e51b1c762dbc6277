#!/usr/bin/env bash
# One call on a GPU machine (docs/performance.md, "GPUs: GPT-2 small on one H200"), after
# gpu_lease8.sh found the command line at batch 16 on text at 54 ms a step against 32 ms on uniform
# token ids: the token lookup's gradient alone (bf16 against float32 scatter-add, text against
# uniform ids), then the command line at batch 16 on text, bf16 cold and warm (start-up) and fp8,
# 200 steps each, then the model step against torch.compile at batch 16 (random ids, as before).
# Run from the repository root on the lent machine; everything comes back under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1; D=${OUT:-/tmp/lease9}; mkdir -p "$D"; W=/tmp/w9; rm -rf $W; mkdir -p $W
export JAXDP_COMPILE_CACHE=$W/cache
LOG=$D/log.txt; END=$((SECONDS + ${DEADLINE:-370}))
limit() { local left=$((END - SECONDS)); ((left < $1)) && echo $((left > 1 ? left : 1)) || echo "$1"; }
SHAPE=(--vocab-size 50304 --seq-len 1024 --layers 12 --d-model 768 --heads 12); E=(); STEPS=200; BENCH=()
[[ -n "${GPU_SMALL:-}" ]] && SHAPE=(--vocab-size 512 --seq-len 64 --layers 2 --d-model 64 --heads 2) \
  && E=(--tokens 512 --width 64 --vocab 512 --repeats 2) && STEPS=20 && BENCH=(--vocab-size 512 --seq-len 64 --layers 2 --d-model 64 --heads 2)
echo "=== embed ($(date +%T))" | tee -a "$LOG"
timeout "$(limit 40)" python docs/perf/gpu_tools.py embed "${E[@]}" --json "$D/embed.json" 2>&1 | tail -4 | tee -a "$LOG"
python -c "
import glob, sysconfig, numpy as np
b = b''.join(open(f, 'rb').read() for f in sorted(glob.glob(sysconfig.get_paths()['stdlib'] + '/*.py')))
np.frombuffer(b, np.uint8).astype(np.uint16).tofile('$W/text.bin'); print('text bytes', len(b))" 2>&1 | tee -a "$LOG"
GPT=(--model gpt --dataset $W/text.bin "${SHAPE[@]}" --optimizer adamw --lr 3e-4 --log-every 50 --no-progress
     --eval-batches 16 --devices 1 --batch-size 16 --seed 0)
cli() {  # cli NAME LIMIT FLAGS...
  local name=$1 lim=$2; shift 2
  echo "=== cli $name ($(date +%T))" | tee -a "$LOG"
  timeout "$(limit "$lim")" python -m jaxdp.train "${GPT[@]}" --metrics-file "$D/$name.jsonl" "$@" 2>&1 | tail -1 | cut -c1-400 | tee -a "$LOG"
}
cli b16-bf16 130 --steps $STEPS --precision bf16
cli b16-bf16-warm 40 --steps 20 --precision bf16
cli b16-fp8 90 --steps $STEPS --precision fp8
echo "=== bench gpt --vs-torch ($(date +%T))" | tee -a "$LOG"
timeout "$(limit 160)" python -m jaxdp.bench gpt --vs-torch "${BENCH[@]}" --batch-sizes 16 --steps 10 --repeats 3 \
  --json "$D/gpt-vs-torch.json" 2>&1 | tail -6 | tee -a "$LOG"
python - "$D" <<'PY' 2>&1 | tee -a "$LOG"
import glob, json, os, sys
for path in sorted(glob.glob(sys.argv[1] + "/*.jsonl")):
    rows = [json.loads(l) for l in open(path)]
    steps = [r for r in rows if r.get("steps_per_sec")]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    print(os.path.basename(path), [(r["step"], round(1000 / r["steps_per_sec"], 2), r.get("mfu"), round(r["tokens_per_sec"]))
                                   for r in steps], "eval", evals[-1:])
PY
