#!/usr/bin/env bash
# Device run 36 (nvidia-h200-x2, ~5 minutes): written in session 4, run in session 5 (results/h200/README.md "Session 5"). Measures
# what session 4 could only measure on the CPU: decode tokens as AttnBlocks (149eaf0) and the scheduler's shared
# empty views (8366051), against the tree before them (a57c86e: merge by dispatch position, pinned ring, compiled
# router, whole-group merges already in). Before the call, on the CPU machine:
#   mkdir -p .df/ab && git archive a57c86e | gzip > .df/ab/old.tgz      # then: carry [".whl", ".df/ab"]
# (1) GPU tests (CUDA exchange) and fp32 2-GPU tokens == CPU (defrag, defrag + hold); (2) old vs new, streaming/defrag
# + 30 ms hold, GPT-OSS-20B cut to 8 layers, bf16, C=256 (round-robin homes), clean, 3 alternating rounds, phase
# timers of both ranks; (3) all-gather EP once with this tree. Output: env.txt, tokens.txt, ab.txt, phases.txt, agep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/gpu_checks.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000"
bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 3 --budget 110 --systems "streaming-defrag:hold_fill=1;hold_us=30000" \
  --scenarios clean --concurrency 256 --new-tokens 64:128
P=$(mktemp -d /tmp/run36.XXXX)
timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/ag" --budget 140 --systems ag-ep --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ag.log" 2>&1
echo "ag exit $?" >> "$OUT/env.txt"; cp "$P/ag/ep_bench.md" "$OUT/agep.md"; grep "^| ag" "$OUT/agep.md" | cut -c1-200
