#!/usr/bin/env bash
# Device run 55 (nvidia-h200-x2, ~6 minutes): written in session 7, not run yet. Measures what session 7 could not: its
# host-path changes made after the last device run, together, against the tree before them (1508b2a): the bounded
# device waits (3e5aeba: host_staging.wait_event polls the event instead of cudaEventSynchronize; NOTES §22 item 11),
# the routing read as numpy arrays (CudaExecutor.route_arrays) and cached static-buffer views in the decode attention
# (~12 fewer torch calls per attention batch together; items 14-15).
# A loss means splitting them (git revert the commits one at a time for more trees). Also the attention host time per
# batch on a normal instance after the routing-wait fix (item 9) and the GPU busy column (item 12).
# Before the call, on the CPU machine:
#   mkdir -p .df/ab && git archive 1508b2a | gzip > .df/ab/old.tgz      # then: carry [".whl", ".df/ab"]
# (1) GPU tests and fp32 2-GPU tokens == CPU (defrag, defrag + hold); (2) old vs new, streaming/defrag + 30 ms hold,
# GPT-OSS-20B cut to 8 layers, bf16, C=256, clean, 3 alternating rounds, phase timers of both ranks; (3) all-gather
# EP once with this tree (host us per batch, both definitions, and the new GPU busy column). Output: env.txt, tokens.txt, ab.txt, phases.txt, agep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/gpu_checks.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000"
bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 3 --budget 110 --systems "streaming-defrag:hold_fill=1;hold_us=30000" \
  --scenarios clean --concurrency 256 --new-tokens 64:128
P=$(mktemp -d /tmp/run55.XXXX)
timeout 100 python3 benchmarks/gpu_ep_bench.py --out "$P/ag" --budget 90 --systems ag-ep --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ag.log" 2>&1
echo "ag exit $?" >> "$OUT/env.txt"; cp "$P/ag/ep_bench.md" "$OUT/agep.md"; grep "^| ag" "$OUT/agep.md" | cut -c1-220
