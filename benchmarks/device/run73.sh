#!/usr/bin/env bash
# Device run 73 (nvidia-h200-x2, TWO GPUs, ~6 minutes): session 10, first. (1) gpu_bench e2e on GPU 0 (in-process
# ranks, default dispatch: device-routed on a cuda plan), streaming/defrag only, C=64,256: d746ce9 (prepare() also
# captures the device-routed expert graphs) measured for the first time; the "graphs: prepare / in run" column must
# read N / 0. (2) A py-spy profile of streaming/defrag + 30 ms hold, 20B-L8, bf16, C=256, clean, 2 GPUs over NCCL,
# the default dispatch (run 37's settings, run 37 was host-routed): where complete:attn's Python goes now.
# Raw profile carried back gzipped (benchmarks/pyspy_summary.py --under F summarizes any subtree here).
# Output: env.txt, gpu_bench.md, pyspy_raw.txt.gz, pyspy_summary.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
nproc >> "$OUT/env.txt"; lscpu | grep -i "model name" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/gpu_bench.py --out "$OUT" --sections e2e --systems streaming \
  --concurrency 64,256 > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench e2e exit $?" | tee -a "$OUT/env.txt"; grep "graphs captured\|tokens/s" "$OUT/gpu_bench.log"
P=$(mktemp -d /tmp/run73.XXXX)
timeout 220 /tmp/site/bin/py-spy record --subprocesses --threads --idle --nonblocking --rate 500 --format raw -o "$P/pyspy_py.txt" -- \
  python3 benchmarks/gpu_ep_bench.py --out "$P/ep" --budget 150 --systems "streaming-defrag:hold_fill=1;hold_us=30000" \
  --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "spy exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep/ep_bench.md" "$OUT/ep.md"; grep "^| streaming" "$OUT/ep.md" | cut -c1-240
gzip -c "$P/pyspy_py.txt" > "$OUT/pyspy_raw.txt.gz"
python3 benchmarks/pyspy_summary.py "$P/pyspy_py.txt" --top 70 > "$OUT/pyspy_summary.txt"; head -40 "$OUT/pyspy_summary.txt"
