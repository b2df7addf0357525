#!/usr/bin/env bash
# Device run 37 (nvidia-h200-x2, ~4 minutes), session 5: price the host operations on the device host
# (benchmarks/host_speed.py: a Python loop, numpy, the Zipf router, pickle; CUDA allocation, launches, pinned copies,
# events, a graph replay, a Triton launch) and py-spy the tree after run 36 (decode blocks, shared views, one dispatch
# gather), streaming/defrag + 30 ms hold, GPT-OSS-20B cut to 8 layers, bf16, C=256, clean (run 30's settings), raw
# profile carried back gzipped so any subtree can be summarized here (benchmarks/pyspy_summary.py --under F).
# Output: env.txt, host_speed.txt, pyspy_raw.txt.gz, pyspy_summary.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; nproc >> "$OUT/env.txt"; lscpu | grep -i "model name" >> "$OUT/env.txt"
python3 benchmarks/host_speed.py --reps 2000 > "$OUT/host_speed.txt" 2>&1; cat "$OUT/host_speed.txt"
P=$(mktemp -d /tmp/run37.XXXX)
timeout 200 /tmp/site/bin/py-spy record --subprocesses --threads --idle --nonblocking --rate 500 --format raw -o "$P/pyspy_py.txt" -- \
  python3 benchmarks/gpu_ep_bench.py --out "$P/ep" --budget 150 --systems "streaming-defrag:hold_fill=1;hold_us=30000" \
  --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "spy exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep/ep_bench.md" "$OUT/ep.md"; grep "^| streaming" "$OUT/ep.md" | cut -c1-200
gzip -c "$P/pyspy_py.txt" > "$OUT/pyspy_raw.txt.gz"
python3 benchmarks/pyspy_summary.py "$P/pyspy_py.txt" --top 70 > "$OUT/pyspy_summary.txt"; head -60 "$OUT/pyspy_summary.txt"
