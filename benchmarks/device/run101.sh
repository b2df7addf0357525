#!/usr/bin/env bash
# Device run 101 (nvidia-h200-x2, TWO GPUs, ~6 minutes): session 13. Does a larger attention cap cost anything when the
# load is below it? NOTES §29 item 6: one wave of 512 tokens per home (cap 512) gave 1.80x the tokens/s of one of 256,
# and two waves of 256 (cap 256 at C=512) lose 37-42%. If a cap above the load costs nothing (the batch takes the
# bucket of its own size), the default cap can be large and the wave follows the load. (0) host_speed.py: the host
# price of a Triton launch and of torch calls on this stack; (1) streaming/defrag + 30 ms hold, 20B-L8, bf16, clean,
# one round per launch: C=256 at cap 256 and at cap 1024; C=512 at cap 512 and at cap 1024; C=1024 at cap 1024. Each
# launch's log keeps its start-up (capture) time. Output: env.txt, host_speed.txt, capC_capN.md, startup.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 60 python3 benchmarks/host_speed.py --reps 1000 > "$OUT/host_speed.txt" 2>&1; echo "host_speed exit $?" >> "$OUT/env.txt"
SYS="streaming-defrag:hold_fill=1;hold_us=30000"
P=$(mktemp -d /tmp/run101.XXXX)
for cc in 256:256 256:1024 512:512 512:1024 1024:1024; do
  C=${cc%:*}; CAP=${cc#*:}
  timeout 100 python3 benchmarks/gpu_ep_bench.py --out "$P/$C-$CAP" --budget 90 --rounds 1 --attn-cap $CAP --systems "$SYS" \
    --scenarios clean --concurrency $C --new-tokens 64:128 > "$P/$C-$CAP.log" 2>&1
  echo "C=$C cap=$CAP exit $?" | tee -a "$OUT/env.txt"; cp "$P/$C-$CAP/ep_bench.md" "$OUT/cap${C}_cap${CAP}.md"
  cp "$P/$C-$CAP.log" "$OUT/cap${C}_cap${CAP}.log"
  grep "^| " "$OUT/cap${C}_cap${CAP}.md" | grep -v "^|---" | cut -c1-200
done
cat "$OUT/host_speed.txt"
