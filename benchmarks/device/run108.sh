#!/usr/bin/env bash
# Device run 108 (nvidia-h200-x2, TWO GPUs, ~3 minutes): session 14, a diagnosis. Where a rank's host time per
# layer-wave goes, by function: run 107's phases put feed (the arriving messages' handling: the holders' partial sums'
# merges and combines, the payloads' enqueue) at 81-90 us per call, poll at 81-105 and next_batch at 60-76, together
# ~40% of the loop, with no breakdown. Launch 1: cProfile on (every Python call timed; relative shares, not absolute
# prices), 20B-L8, bf16, C=512, streaming/defrag + 30 ms hold, clean: per rank the top functions by own and by
# cumulative time and the callees of the loop's phases. Launch 2, same setting, cProfile off: the executor's and the
# dispatch's laps (DATAFLOW_PROFILE_EXEC=1) and the transport's (DATAFLOW_PROFILE_TRANSPORT=1) with the phases.
# Output: env.txt, prof.txt (launch 1), laps.log + phases.txt (launch 2), ep1.md, ep2.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run108.XXXX)
BENCH="benchmarks/gpu_ep_bench.py --budget 80 --rounds 1 --systems streaming-defrag:hold_fill=1;hold_us=30000 --scenarios clean --concurrency 512 --new-tokens 64:128"
DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=1 DATAFLOW_PROFILE_OUT="$P/c{rank}.prof" \
  timeout 100 python3 $BENCH --out "$P/a" > "$P/a.log" 2>&1
echo "cprofile exit $?" | tee -a "$OUT/env.txt"; cp "$P/a/ep_bench.md" "$OUT/ep1.md"
python3 - "$P" > "$OUT/prof.txt" 2>&1 <<'PY'
import io, pstats, sys
P = sys.argv[1]
for k in (0, 1):
    print(f"=== rank {k}")
    print(open(f"{P}/c{k}.prof.phases.txt").read().split("\n\n")[0])
    for key, n in (("tottime", 45), ("cumulative", 45)):
        s = io.StringIO(); pstats.Stats(f"{P}/c{k}.prof", stream=s).sort_stats(key).print_stats(n); print(s.getvalue())
    s = io.StringIO(); st = pstats.Stats(f"{P}/c{k}.prof", stream=s).sort_stats("cumulative")
    st.print_callees(r"on_message|_merged|_merge_rows|next_batch|views|\bpoll\b|_complete_expert|_complete_attn|_exec_attn|_dispatch_routed|\bsend\b|_post\b|combine\b|topk_merge\b|_forward|_completed|_add_run|take\b|choose")
    print(s.getvalue())
PY
DATAFLOW_PROFILE_EXEC=1 DATAFLOW_PROFILE_TRANSPORT=1 DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 \
  DATAFLOW_PROFILE_OUT="$P/p{rank}.prof" timeout 100 python3 $BENCH --out "$P/b" > "$OUT/laps.log" 2>&1
echo "laps exit $?" | tee -a "$OUT/env.txt"; cp "$P/b/ep_bench.md" "$OUT/ep2.md"
for k in 0 1; do echo "=== rank $k"; head -30 "$P/p$k.prof.phases.txt"; done > "$OUT/phases.txt" 2>&1
grep "^| streaming" "$OUT"/ep*.md | cut -c1-200
grep -E "===|loop iterations" "$OUT/phases.txt"
