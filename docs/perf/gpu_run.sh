#!/usr/bin/env bash
# The GPU figures in docs/performance.md ("One GPU"), measured in one call on one lent GPU. Run from
# the repository root, with the project importable (PYTHONPATH=. on a machine whose JAX is
# preinstalled); results go to $OUT (default: docs/perf/gpu). Each stage has its own time limit, so
# a slow stage costs its own figures, not the ones after it.
#   bash docs/perf/gpu_run.sh
# GPU_SMALL=1 runs every stage on a tiny GPT (a check of the script on a CPU). GPU_STAGES="variants cli-b16
# ..." runs only the stages named (default: all of them, in the order below).
set -uo pipefail
OUT=${OUT:-docs/perf/gpu}; mkdir -p "$OUT"
W=${WORK:-/tmp/jaxdp-gpu}; rm -rf "$W"; mkdir -p "$W"
export PYTHONUNBUFFERED=1 JAXDP_COMPILE_CACHE=$W/cache
LOG=$OUT/log.txt
END=$((SECONDS + ${GPU_DEADLINE:-540} - 25))  # the summary and the archive need the last 25 s
stage() { echo "=== $1 ($(date +%T))" | tee -a "$LOG"; }
want() { [[ -z "${GPU_STAGES:-}" || " $GPU_STAGES " == *" $1 "* ]]; }
limit() { local left=$((END - SECONDS)); ((left < $1)) && echo $((left > 1 ? left : 1)) || echo "$1"; }  # a stage's limit
python - <<'PY' 2>&1 | tee -a "$LOG"
import importlib.metadata as m, jax
for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers", "numpy"):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, "-")
print(jax.devices(), [getattr(d, "compute_capability", None) for d in jax.devices()])
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"

if [[ -n "${GPU_SMALL:-}" ]]; then
  SHAPE=(--vocab-size 512 --seq-len 64 --layers 2 --d-model 64 --heads 2); B16=4; B32=8; VOCAB=512; STEPS=30; TRACED=10
  BENCH_SHAPE=(--vocab-size 512 --seq-len 64 --layers 2 --d-model 64 --heads 2); NEW=16
else
  SHAPE=(--vocab-size 50304 --seq-len 1024 --layers 12 --d-model 768 --heads 12); B16=16; B32=32; VOCAB=50304; STEPS=100
  TRACED=30; BENCH_SHAPE=(); NEW=256
fi
# Text, not uniform ids: the Python standard library's bytes as token ids. Uniform ids hid a step 1.7x
# slower on text (a bf16 scatter-add where tokens share rows; docs/performance.md, "The token lookup").
python -c "
import glob, sysconfig, numpy as np
b = b''.join(open(f, 'rb').read() for f in sorted(glob.glob(sysconfig.get_paths()['stdlib'] + '/*.py')))
np.frombuffer(b, np.uint8).astype(np.uint16).tofile('$W/tokens.bin')"
GPT=(--model gpt --dataset "$W/tokens.bin" "${SHAPE[@]}" --precision bf16 --optimizer adamw --lr 3e-4
     --log-every 20 --no-progress --eval-batches 1 --devices 1)
cli() {  # cli NAME LIMIT_S FLAGS...: one CLI run, its metrics in $W/NAME.jsonl
  local name=$1 limit=$2; shift 2
  stage "cli $name"
  timeout "$(limit "$limit")" python -m jaxdp.train "${GPT[@]}" --metrics-file "$W/$name.jsonl" "$@" 2>&1 | tail -3 | tee -a "$LOG"
}

# 0. Candidates for the step, side by side in one process: XLA options for the matrix products and LayerNorm.
#    The fastest one's options go to the command line below.
if want variants; then
  stage "variants"
  timeout "$(limit ${VARIANTS_S:-170})" python docs/perf/gpu_tools.py variants "${VARIANTS:-default;xla_gpu_enable_triton_gemm=false;xla_gpu_enable_cublaslt=true;xla_gpu_cudnn_gemm_fusion_level=2;xla_gpu_enable_cudnn_layer_norm=true}" \
    --batch $B16 --budget-s $(( ${VARIANTS_S:-170} - 40 )) --json "$W/variants.json" 2>&1 | tail -9 | tee -a "$LOG"
  BEST=$(python -c "import json, sys; v = json.load(open(sys.argv[1]))['best_options']; print(' '.join(f'--{k}={str(x).lower()}' for k, x in v.items()))" "$W/variants.json" 2>/dev/null)
  [[ -n "$BEST" ]] && export XLA_FLAGS="${XLA_FLAGS:-} $BEST" && echo "XLA_FLAGS for the command line: $XLA_FLAGS" | tee -a "$LOG"
fi
# 1. The command line at batch 16: an empty compilation cache, then the same command warm (start-up).
want cli-b16 && cli b16-cold 200 --batch-size $B16 --steps $STEPS
want cli-b16 && cli b16-warm 60 --batch-size $B16 --steps $STEPS
# 1b. Warm start-ups: JAX's allocator reserving its pool at the first buffer (the default) against
#     XLA_PYTHON_CLIENT_PREALLOCATE=false, alternating, 20 steps each; then one warm start-up phase by phase.
if want startup-phases; then
  for i in $(seq "${STARTUP_REPEATS:-3}"); do
    for prealloc in true false; do
      stage "cli warm, preallocate $prealloc, $i"
      XLA_PYTHON_CLIENT_PREALLOCATE=$prealloc timeout "$(limit 40)" python -m jaxdp.train "${GPT[@]}" --batch-size $B16 \
        --steps 20 --metrics-file "$W/warm-prealloc-$prealloc-$i.jsonl" 2>&1 | tail -1 | tee -a "$LOG"
    done
  done
  stage "start-up phases"
  timeout "$(limit 40)" python docs/perf/gpu_tools.py startup --json "$W/startup-phases.json" -- "${GPT[@]}" \
    --batch-size $B16 --steps 20 2>&1 | grep -v "^jaxdp" | tail -12 | tee -a "$LOG"
fi
# 1c. The codecs' own work on the card (one device: no exchange, the encode and decode alone).
if want codecs; then
  stage "codecs"
  timeout "$(limit 90)" python docs/perf/gpu_tools.py codecs "${CODECS:-bf16;int8;int4;powersgd:4;topk:0.01}" \
    --json "$W/codecs.json" 2>&1 | tail -6 | tee -a "$LOG"
fi
# 1c'. The top-k codec's selection alone: jax.lax.top_k against approx_max_k, by chunk length and density.
if want select; then
  stage "select"
  timeout "$(limit 90)" python docs/perf/gpu_tools.py select --json "$W/select.json" 2>&1 | tail -13 | tee -a "$LOG"
fi
# 1c''. --optimizer muon against adamw at batch 16: what Newton-Schulz costs a step on the card.
want muon && cli b16-adamw 120 --batch-size $B16 --steps 60
want muon && cli b16-muon 120 --batch-size $B16 --steps 60 --optimizer muon
# 1c'''. The optimizer update alone: AdamW, and Muon's Newton-Schulz under each matmul precision.
if want muon-update; then
  stage "muon update"
  timeout "$(limit 90)" python docs/perf/gpu_tools.py muon --json "$W/muon-update.json" 2>&1 | tail -5 | tee -a "$LOG"
fi
# 1d. --shard-params on one card: the blocks gathered one at a time in a rematerialised scan.
want shard && cli b16-shard 150 --batch-size $B16 --steps 60 --shard-params
# 2. Where a step's time goes: the warm command line again, under JAX's profiler from its step 10.
#    TRACE_FLAGS adds flags to the traced run (e.g. "--optimizer muon"), TRACE_NAME names its files.
if want trace; then
  T=${TRACE_NAME:-b16}
  stage "trace $T"
  timeout "$(limit 120)" python docs/perf/gpu_tools.py trace "$W/trace" --skip 10 -- "${GPT[@]}" --batch-size $B16 --steps $((TRACED + 10)) \
    --metrics-file "$W/$T-trace.jsonl" --checkpoint-dir "$W/ckpt" ${TRACE_FLAGS:-} 2>&1 | tail -2 | tee -a "$LOG"
  timeout "$(limit 60)" python docs/perf/gpu_tools.py summarize "$W/trace" --steps $TRACED --json "$W/profile-$T.json" 2>&1 | tee -a "$LOG"
fi
# 3. The model step against PyTorch (torch.compile), paired, at both batch sizes.
if want vs-torch; then
  stage "bench gpt --vs-torch"
  timeout "$(limit 240)" python -m jaxdp.bench gpt --vs-torch "${BENCH_SHAPE[@]}" --batch-sizes $B16,$B32 --steps 10 --repeats 5 \
    --json "$W/gpt-vs-torch.json" 2>&1 | tail -7 | tee -a "$LOG"
fi
# 4. Batch 32 through the command line.
want cli-b32 && cli b32 150 --batch-size $B32 --steps $STEPS
# 5. Where a warm start-up's seconds go (cProfile, cumulative; one step).
if want startup; then
  stage "start-up profile"
  timeout "$(limit 60)" python -m cProfile -o "$W/startup.prof" -m jaxdp.train "${GPT[@]}" --batch-size $B16 --steps 1 2>&1 | tail -1 | tee -a "$LOG"
  python -c "import pstats; pstats.Stats('$W/startup.prof').sort_stats('cumulative').print_stats(45)" 2>&1 | grep -v "^$" | cut -c1-160 | tail -48 | tee -a "$LOG"
fi
# 6. Sampling with the key/value cache against Hugging Face's generate on the exported model.
if want sample; then
  stage "sample"
  timeout "$(limit 40)" python -m jaxdp.export "$W/hf" --checkpoint-dir "$W/ckpt" --format hf 2>&1 | tail -2 | tee -a "$LOG"
  timeout "$(limit 90)" python docs/perf/gpu_tools.py sample "$W/ckpt" "$W/hf" --new-tokens $NEW --json "$W/sample.json" 2>&1 | tail -3 | tee -a "$LOG"
fi

# 9. Issue 40's card item: the largest GPT-2 configuration that trains on one card, replicated against
#    --shard-params (one device: ZeRO-1 would shard over one device, nothing; --shard-params keeps the
#    blocks rematerialised, one gathered at a time), batch LARGEST_B, 10 steps each, with
#    XLA_PYTHON_CLIENT_MEM_FRACTION=LARGEST_FRACTION (each run's device peak is in its done record).
#    Then each again, warm from the compilation cache, on an emulated smaller card: LARGEST_CARD of the
#    memory (0.17 of an H200 is about 24 GB), skipping a mode once it ran out of memory on a smaller
#    configuration. On an H200 the replicated (unrolled) GPT-2 large took over 150 s to compile cold:
#    give the stage LARGEST_S=300 or more. LARGEST_MODELS="medium ..." and LARGEST_MODES="replicated"
#    run only those.
if want largest; then
  if [[ -n "${GPU_SMALL:-}" ]]; then CONFIGS=("2 64 2 tiny" "3 128 2 small"); else
    CONFIGS=("24 1024 16 medium" "36 1280 20 large" "48 1600 25 xl"); fi
  largest() {  # largest NAME-SUFFIX FRACTION LIMIT L D H NAME MODE
    local suffix=$1 fraction=$2 lim=$3 L=$4 D=$5 H=$6 NAME=$7 mode=$8 extra=()
    [[ $mode == shard ]] && extra=(--shard-params)
    stage "largest $NAME $mode, memory fraction $fraction"
    XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction timeout "$(limit "$lim")" python -m jaxdp.train \
      "${GPT[@]}" --layers "$L" --d-model "$D" --heads "$H" --batch-size "${LARGEST_B:-8}" --steps 10 --log-every 5 \
      --metrics-file "$W/largest-$NAME-$mode$suffix.jsonl" "${extra[@]}" > "$W/largest-$NAME-$mode$suffix.log" 2>&1
    tail -2 "$W/largest-$NAME-$mode$suffix.log" | cut -c1-300 | tee -a "$LOG"
  }
  for cfg in "${CONFIGS[@]}"; do
    read -r _ _ _ NAME <<< "$cfg"
    [[ -n "${LARGEST_MODELS:-}" && " $LARGEST_MODELS " != *" $NAME "* ]] && continue
    for mode in ${LARGEST_MODES:-replicated shard}; do largest "" "${LARGEST_FRACTION:-0.75}" "${LARGEST_S:-300}" $cfg $mode; done
  done
  if [[ -n "${LARGEST_CARD:-}" ]]; then
    declare -A failed=()
    for cfg in "${CONFIGS[@]}"; do
      for mode in replicated shard; do
        read -r _ _ _ NAME <<< "$cfg"
        [[ -n "${failed[$mode]:-}" ]] && { echo "largest $NAME $mode on the smaller card: skipped" | tee -a "$LOG"; continue; }
        largest "-card" "$LARGEST_CARD" 60 $cfg $mode
        grep -qi 'RESOURCE_EXHAUSTED\|out of memory' "$W/largest-$NAME-$mode-card.log" && failed[$mode]=1
      done
    done
  fi
fi

stage "summary"
python - "$W" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, sys
w = sys.argv[1]
import glob
runs = ["b16-cold", "b16-warm", "b16-trace", "muon-trace", "b32", "b16-shard", "b16-adamw", "b16-muon"]
runs += sorted(os.path.basename(p)[:-6] for p in glob.glob(f"{w}/warm-*.jsonl"))
for run in runs:
    path = f"{w}/{run}.jsonl"
    if not os.path.exists(path):
        print(f"cli {run}: no metrics"); continue
    rows = [json.loads(l) for l in open(path)]
    steps = [r for r in rows if "event" not in r and r.get("steps_per_sec")]
    done = [r for r in rows if "startup_s" in r]
    if not steps:
        print(f"cli {run}: no steady steps"); continue
    s, d = steps[-1], (done[-1] if done else {})
    print(f"cli {run}: step {1000 / s['steps_per_sec']:.2f} ms, tokens/s {s.get('tokens_per_sec', 0):.0f}, mfu {s.get('mfu')}, "
          f"start-up {d.get('startup_s', float('nan')):.2f} s, first step {d.get('compile_s') or float('nan'):.2f} s, "
          f"cache hits {d.get('compile_cache_hits')}")
PY
python - "$W" <<'PY' 2>&1 | tee -a "$LOG"
import glob, json, os, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/largest-*.jsonl")):
    rows = [json.loads(l) for l in open(path)]
    done = [r for r in rows if r.get("event") == "done"]
    steps = [r for r in rows if "event" not in r and r.get("steps_per_sec")]
    peak = done[-1].get("device_peak_bytes") if done else None
    compiled = rows[0].get("compiled_peak_bytes_per_device") if rows else None
    print(f"{os.path.basename(path)[8:-6]}: {'trained' if done else 'did not finish'}"
          + (f", {1000 / steps[-1]['steps_per_sec']:.1f} ms a step" if steps else "")
          + (f", device peak {peak / 2**30:.2f} GiB" if peak else "")
          + (f", XLA's compiled peak {compiled / 2**30:.2f} GiB" if compiled else ""))
PY
tar czf "$OUT/results.tgz" -C "$W" $(cd "$W" && ls *.jsonl *.json *.log startup.prof 2>/dev/null)
cp "$W"/*.json "$OUT"/ 2>/dev/null || true
cp "$(find "$W/trace" -name perfetto_trace.json.gz | head -1)" "$OUT/trace.json.gz" 2>/dev/null || true
ls -la "$OUT"
