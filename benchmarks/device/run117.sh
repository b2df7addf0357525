#!/usr/bin/env bash
# Device run 117 (nvidia-h200-x2, TWO GPUs, ~6 minutes; NOT RUN in session 15: no two-GPU machine was lent): session
# 15's tree (NOTES §32) over NCCL, with the two NCCL-only changes that were reverted until they run on two GPUs brought
# back first (`git cherry-pick 165d62f 45df8d4 e9d962f`: transfers' events recorded again, receive buffers made on the
# engine's stream). (1) the NCCL transport tests on two GPUs and the
# kernel/executor/runtime-unit tests; (2) gpu_bench correctness on GPU 0; (3) fp32 2-GPU tokens == CPU; (4) A/B against
# 3cdf379 (session 14's last tree), 20B-L8, bf16, C=512, clean, streaming/defrag + 30 ms hold, 2 rounds, with wave
# timelines and phases (run 110's setting, one round fewer: this session's device time).
# Before the call: mkdir -p .df/ab && git archive 3cdf379 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, checks.txt, gpu_bench.md, tokens.txt, ab.txt, phases.txt, timelines.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_transport_dist.py tests/test_kernels.py \
  tests/test_executor_cuda.py tests/test_runtime_units.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
DATAFLOW_TIMELINE=1 AB_TIMEOUT=70 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 2 --budget 55 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 512 --new-tokens 64:128
cut -c1-150 "$OUT/ab.txt"
python3 benchmarks/ab_summary.py "$OUT/ab.txt" 2>&1 | tail -4
grep -E "^===|^  (attn host|cycle|home tail|back)|host us, median" "$OUT/timelines.txt" | head -40
