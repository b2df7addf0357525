#!/usr/bin/env bash
# Device run 75 (nvidia-h200-x2, TWO GPUs, ~8 minutes): session 10. Holders return per-token partial sums (NOTES §27
# item 3): the routed expert graph weights and sums each token's own slots (topk_merge from zero), one row per token
# goes back (1/k of the combine's bytes), the home's merge lands each holder's rows in place and its combine adds them.
# (1) gpu_bench correctness on GPU 0, both FFN implementations; (2) fp32 2-GPU NCCL tokens == CPU with the same
# dispatch (and against the host-routed CPU run, for the record); (3) A/B against 39369fa (the payload, before this),
# 20B-L8, bf16, C=256, streaming/defrag + 30 ms hold and all-gather EP in each launch, clean and NVLink hog (where
# fewer bytes should show), 1 round (ab_trees.sh).
# Before the call: mkdir -p .df/ab && git archive 39369fa | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, gpu_bench.md, tokens.txt, ab.txt, phases.txt, ep_old1.md, ep_new1.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
grep -i "fail\|mismatch" "$OUT/gpu_bench.log" | head -5
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" defrag | grep "2-GPU"
AB_TIMEOUT=205 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 1 --budget 200 --launch-timeout 100 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,nvlink-hog --concurrency 256 \
  --new-tokens 64:128
for f in /tmp/ab.*/*/ep_bench.md; do d=$(basename "$(dirname "$f")"); cp "$f" "$OUT/ep_$d.md"; echo "== $d"
  grep "^| " "$f" | grep -v "^|---" | cut -c1-200; done
