#!/usr/bin/env bash
# Device run 103 (nvidia-h200-x2, TWO GPUs, ~8 minutes): session 13's tree (default attention cap 1024;
# kernels/fast_launch.py). (0) triton_launch_bench: the topk_merge wrapper taken apart (run 102: wrapper 58 us, its
# JIT launch 18, a direct CompiledKernel.run 7.3); (1) the kernel and fast-launch tests on the GPU; gpu_bench
# correctness on GPU 0; fp32 2-GPU tokens == CPU (plans at the new default cap); (2) A/B of the direct Triton launch,
# DATAFLOW_TRITON_LAUNCH=direct vs jit, streaming/defrag + 30 ms hold, 20B-L8, C=256, clean, 3 rounds alternating;
# (3) the C=1024 column at the default cap: streaming against all-gather EP, clean, NVLink hog, compute hog, one round.
# Output: env.txt, triton_launch.txt, gpu_bench.md, tokens.txt, ab.md, ep1024.md, logs.tgz.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run103.XXXX)
timeout 60 python3 benchmarks/triton_launch_bench.py --reps 1000 > "$OUT/triton_launch.txt" 2>&1; echo "triton_launch exit $?" >> "$OUT/env.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fast_launch.py tests/test_kernels.py > "$P/pytest.log" 2>&1
echo "pytest kernels exit $?: $(tail -1 "$P/pytest.log")" | tee -a "$OUT/env.txt"
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$P/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$P/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
timeout 170 python3 benchmarks/gpu_ep_bench.py --out "$P/ab" --budget 160 --rounds 3 \
  --variants "direct:DATAFLOW_TRITON_LAUNCH=direct;jit:DATAFLOW_TRITON_LAUNCH=jit" \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128 \
  > "$P/ab.log" 2>&1
echo "ab exit $?" | tee -a "$OUT/env.txt"; cp "$P/ab/ep_bench.md" "$OUT/ab.md"; grep "^| " "$OUT/ab.md" | grep -v "^|---" | cut -c1-200
timeout 200 python3 benchmarks/gpu_ep_bench.py --out "$P/c1024" --budget 190 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,nvlink-hog,compute-hog \
  --concurrency 1024 --new-tokens 64:128 > "$P/c1024.log" 2>&1
echo "ep1024 exit $?" | tee -a "$OUT/env.txt"; cp "$P/c1024/ep_bench.md" "$OUT/ep1024.md"
grep "^| " "$OUT/ep1024.md" | grep -v "^|---" | cut -c1-200
grep -i "error\|failed\|timed out\|skipped" "$P/ab.log" "$P/c1024.log" | grep -v "TCPStore\|should dump" | head -5 | tee -a "$OUT/env.txt"
tar czf "$OUT/logs.tgz" -C "$P" .
cat "$OUT/triton_launch.txt"
