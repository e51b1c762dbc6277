#!/usr/bin/env bash
# The sixth GPU lease's one call (docs/performance.md, "A sixth lease"): jaxdp against torch.compile at
# batch 16 and 32, then Muon's update alone and a profile of the command line with --optimizer muon.
# Run from the repository root on the lent machine; everything comes back as $OUT/lease6.tgz.
export PYTHONPATH=. PYTHONUNBUFFERED=1; D=$OUT; R=/tmp/res; rm -rf $R; mkdir -p $R
OUT=$R/torch WORK=/tmp/w1 GPU_STAGES=vs-torch GPU_DEADLINE=${D1:-270} bash docs/perf/gpu_run.sh > $R/torch.out 2>&1
tail -12 $R/torch.out
OUT=$R/muon WORK=/tmp/w2 GPU_STAGES="muon-update trace" TRACE_NAME=muon TRACE_FLAGS="--optimizer muon" GPU_DEADLINE=${D2:-230} bash docs/perf/gpu_run.sh > $R/muon.out 2>&1
tail -40 $R/muon.out
rm -f $R/*/trace.json.gz; tar czf $D/lease6.tgz -C $R .; ls -la $D
