#!/usr/bin/env bash
# Device run 71 (nvidia-h200-x2, TWO GPUs, ~6 minutes): session 9, last. (1) fp32 2-GPU NCCL tokens == CPU with the
# default dispatch (device-routed) after 8a96f92 (summed merge groups take a whole first part as their buffer;
# route_device in one split); (2) 8a96f92 against 26fe734 (before it), both device-routed by default, 20B-L8, bf16,
# C=256, clean, streaming/defrag + 30 ms hold, 3 rounds (ab_trees.sh): complete:attn and feed per call in phases.txt;
# (3) run 70's C=64 cell again with a per-launch limit that fits the barrier launch (run 70's round 1 barrier launch
# hit its 60 s limit): streaming against all-gather and all-to-all EP, clean and compute hog, 1 round.
# Before the call: mkdir -p .df/ab && git archive 26fe734 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, tokens.txt, ab.txt, phases.txt, ep20_c64.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" defrag | grep "2-GPU"
AB_TIMEOUT=95 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 3 --budget 80 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128
P=$(mktemp -d /tmp/run71.XXXX)
timeout 200 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 190 --launch-timeout 120 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep,a2a-ep" --scenarios clean,compute-hog --concurrency 64 \
  --new-tokens 64:128 > "$P/ep20.log" 2>&1
echo "ep20 C=64 exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep20_c64.md"
grep "^| " "$OUT/ep20_c64.md" | grep -v "^|---" | cut -c1-210; grep -i "failed\|timed out" "$P/ep20.log" | head -3 >> "$OUT/env.txt"
