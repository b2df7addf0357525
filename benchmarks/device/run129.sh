#!/usr/bin/env bash
# Device run 129 (nvidia-h200, ONE GPU, ~2 minutes): where the final tree's host goes per layer-wave, by Python
# function: one rank process of gpu_ep_bench (no peers), 20B-L8, bf16, C=256, streaming/defrag + 30 ms hold, clean,
# under cProfile (DATAFLOW_PROFILE_CPROFILE=1: relative shares only, the profiler roughly doubles the loop's time),
# with the phases. Output: env.txt, run.log, prof_tottime.txt, prof_cumulative.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run129.XXXX)
DATAFLOW_PROFILE_RANK=0 DATAFLOW_PROFILE_CPROFILE=1 DATAFLOW_PROFILE_OUT="$P/rank{rank}.prof" \
  timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/o" --budget 120 --ranks 1 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128 > "$OUT/run.log" 2>&1
echo "bench exit $?" | tee -a "$OUT/env.txt"
head -20 "$P/rank0.prof.phases.txt" | tee "$OUT/phases.txt"
python3 - "$P/rank0.prof" "$OUT" <<'PY'
import pstats, sys, io
path, out = sys.argv[1], sys.argv[2]
for key in ("tottime", "cumulative"):
    s = io.StringIO()
    pstats.Stats(path, stream=s).sort_stats(key).print_stats(150)
    open(f"{out}/prof_{key}.txt", "w").write(s.getvalue())
PY
head -45 "$OUT/prof_tottime.txt" | tail -38 | cut -c1-160
