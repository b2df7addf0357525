#!/usr/bin/env bash
# Device run 94 (nvidia-h200-x2, TWO GPUs, ~3 minutes): session 12, a diagnosis. Run 93's phases: execute:attn costs
# 305-325 us of host per call in the 2-process NCCL run, while the executor's own laps summed ~150 us in-process
# (run 63), and run 92's py-spy put ~43% of Engine._exec_attn in CudaExecutor._attention's own frame (no Python callee).
# (1) gpu_ep_bench (20B-L8, bf16, C=256, clean, streaming/defrag + 30 ms hold, one round) with DATAFLOW_PROFILE_EXEC=1:
# each rank prints the executor's laps (drop_pending, view, rows_of, meta_h2d, h_copy, replay, out_clone, route_d2h)
# and the engine's dispatch steps at exit; (2) the same launch under py-spy --native (blocking, 200 Hz): the C/C++
# frames under CudaExecutor._attention and the rest of the loop.
# Output: env.txt, ep_laps.log, ep_laps.md, pyspy_native_raw.txt.gz, pyspy_native_attention.txt, pyspy_native_loop.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run94.XXXX)
ARGS=(--budget 60 --rounds 1 --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128)
DATAFLOW_PROFILE_EXEC=1 timeout 120 python3 benchmarks/gpu_ep_bench.py --out "$P/a" "${ARGS[@]}" > "$OUT/ep_laps.log" 2>&1
echo "laps exit $?" | tee -a "$OUT/env.txt"; cp "$P/a/ep_bench.md" "$OUT/ep_laps.md"
grep -E "^executor|attention dispatch" "$OUT/ep_laps.log" | cut -c1-400
timeout 200 /tmp/site/bin/py-spy record --native --subprocesses --threads --idle --rate 200 --format raw -o "$P/spy.txt" -- \
  python3 benchmarks/gpu_ep_bench.py --out "$P/b" "${ARGS[@]}" > "$P/b.log" 2>&1
echo "spy exit $?" | tee -a "$OUT/env.txt"; tail -3 "$P/b.log"
gzip -c "$P/spy.txt" > "$OUT/pyspy_native_raw.txt.gz"
python3 benchmarks/pyspy_summary.py "$P/spy.txt" --under "CudaExecutor._attention" --top 60 > "$OUT/pyspy_native_attention.txt"
python3 benchmarks/pyspy_summary.py "$P/spy.txt" --top 80 > "$OUT/pyspy_native_loop.txt"
head -50 "$OUT/pyspy_native_attention.txt"
