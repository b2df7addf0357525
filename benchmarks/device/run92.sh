#!/usr/bin/env bash
# Device run 92 (nvidia-h200-x2, TWO GPUs, ~5 minutes): session 12, first. (1) gpu_bench correctness on GPU 0: the
# permute kernel's offsets store as rewritten in 1635c0a (two masked stores) has not run on a GPU yet; (2) fp32 2-GPU
# tokens == CPU; (3) a py-spy profile of session 11's tree (streaming/defrag + 30 ms hold, 20B-L8, bf16, C=256, clean,
# 2 GPUs over NCCL, device-routed), run 73's settings: where the 'y' message's 215-260 us of host go (merge, combine)
# and what the attention batch's host time is made of now. Raw profile carried back gzipped.
# Output: env.txt, gpu_bench.md, tokens.txt, ep.md, pyspy_raw.txt.gz, pyspy_summary.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
P=$(mktemp -d /tmp/run92.XXXX)
timeout 220 /tmp/site/bin/py-spy record --subprocesses --threads --idle --nonblocking --rate 500 --format raw -o "$P/pyspy_py.txt" -- \
  python3 benchmarks/gpu_ep_bench.py --out "$P/ep" --budget 150 --systems "streaming-defrag:hold_fill=1;hold_us=30000" \
  --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "spy exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep/ep_bench.md" "$OUT/ep.md"; grep "^| streaming" "$OUT/ep.md" | cut -c1-240
gzip -c "$P/pyspy_py.txt" > "$OUT/pyspy_raw.txt.gz"
python3 benchmarks/pyspy_summary.py "$P/pyspy_py.txt" --top 90 > "$OUT/pyspy_summary.txt"; head -30 "$OUT/pyspy_summary.txt"
