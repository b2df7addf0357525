#!/usr/bin/env bash
# Device run 30 (nvidia-h200-x2, ~3 minutes), session 4: where a streaming rank's loop goes now (after direct NCCL,
# pinned index copies and the merge by dispatch position), for the next lever. py-spy (carried in .whl/), Python
# stacks of every thread, 500 Hz, non-blocking, streaming/defrag + 30 ms hold, GPT-OSS-20B cut to 8 layers, bf16,
# C=256, clean; summarized per rank process by benchmarks/pyspy_summary.py. Output: env.txt, pyspy_summary.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run30.XXXX)
timeout 200 /tmp/site/bin/py-spy record --subprocesses --threads --idle --nonblocking --rate 500 --format raw -o "$P/pyspy_py.txt" -- \
  python3 benchmarks/gpu_ep_bench.py --out "$P/ep" --budget 150 --systems "streaming-defrag:hold_fill=1;hold_us=30000" \
  --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "spy exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep/ep_bench.md" "$OUT/ep.md"; grep "^| streaming" "$OUT/ep.md" | cut -c1-200
python3 benchmarks/pyspy_summary.py "$P/pyspy_py.txt" --top 70 > "$OUT/pyspy_summary.txt"; head -100 "$OUT/pyspy_summary.txt"
