#!/usr/bin/env bash
# Device run 31 (nvidia-h200-x2, ~9 minutes), session 4: index uploads through a pinned ring (runtime/executors/host_staging.py)
# instead of pin_memory() per call, and the synthetic Zipf router's [T, E] work compiled with numba.
# (1) GPU tests (CUDA exchange, in place) and fp32 2-GPU tokens == CPU (defrag, defrag + hold);
# (2) A/B: old tree (the commit before; .df/ab/old.tgz, carry [".whl", ".df/ab"]) vs this tree, streaming/defrag +
#     30 ms hold, GPT-OSS-20B cut to 8 layers, bf16, C=256, clean, 3 alternating rounds, phase timers of both ranks;
# (3) ag-ep once with this tree (same settings) for the ratio. Output: env.txt, tokens.txt, ab.txt, phases.txt, agep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/gpu_checks.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000"
OLD=/tmp/old_tree; mkdir -p $OLD && tar -xzf .df/ab/old.tgz -C $OLD
NEW=$PWD
P=$(mktemp -d /tmp/run31.XXXX)
ARGS=(--budget 110 --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128)
for r in 1 2 3; do
  for v in old new; do
    T=$NEW; [ $v = old ] && T=$OLD
    mkdir -p "$P/$v$r"
    (cd $T && PYTHONPATH=/tmp/site:$T DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/$v$r/rank{rank}.prof" \
      timeout 120 python3 benchmarks/gpu_ep_bench.py --out "$P/$v$r" "${ARGS[@]}" > "$P/$v$r.log" 2>&1)
    echo "$v round $r exit $?" >> "$OUT/env.txt"
    echo "$v $r $(grep '^| streaming' $P/$v$r/ep_bench.md | cut -c1-200)" | tee -a "$OUT/ab.txt"
    for k in 0 1; do echo "=== $v round $r rank $k"; head -16 "$P/$v$r/rank$k.prof.phases.txt"; done >> "$OUT/phases.txt" 2>&1
  done
done
timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/ag" --budget 140 --systems ag-ep --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ag.log" 2>&1
echo "ag exit $?" >> "$OUT/env.txt"; cp "$P/ag/ep_bench.md" "$OUT/agep.md"; grep "^| ag" "$OUT/agep.md" | cut -c1-200
