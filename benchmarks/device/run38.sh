#!/usr/bin/env bash
# Device run 38 (nvidia-h200-x2, ~8 minutes), session 5: the first host-path changes of session 5 against the tree
# after run 36 (7980668). Changes: a merge group's dispatch gather, combine row_index and routing weights uploaded as
# one packed copy whose event is also the buffer's `ready` (was three uploads and two events per attention batch);
# index uploads through flat typed slot views; the current CUDA stream cached and checked by its raw handle; one
# reused event per peer for compute -> send stream ordering; ZMQ_EVENTS before recv (no zmq.Again per empty poll).
# Before the call, on the CPU machine:
#   mkdir -p .df/ab && git archive 7980668 | gzip > .df/ab/old.tgz      # then: carry [".whl", ".df/ab"]
# (1) GPU tests (CUDA exchange) and fp32 2-GPU tokens == CPU (defrag, defrag + hold); (2) old vs new, streaming/defrag
# + 30 ms hold, GPT-OSS-20B cut to 8 layers, bf16, C=256, clean, 3 alternating rounds; (3) all-gather EP once; (4) the
# new tree once more with DATAFLOW_PROFILE_EXEC=1 (step timers of the executor's attention / expert calls and of the
# engine's attention dispatch). Output: env.txt, tokens.txt, ab.txt, phases.txt, agep.md, steps.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/gpu_checks.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000"
ARGS=(--systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128)
bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 3 --budget 110 "${ARGS[@]}"
P=$(mktemp -d /tmp/run38.XXXX)
timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/ag" --budget 140 --systems ag-ep --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ag.log" 2>&1
echo "ag exit $?" >> "$OUT/env.txt"; cp "$P/ag/ep_bench.md" "$OUT/agep.md"; grep "^| ag" "$OUT/agep.md" | cut -c1-200
DATAFLOW_PROFILE_EXEC=1 DATAFLOW_PROFILE_TRANSPORT=1 timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/st" --budget 110 "${ARGS[@]}" > "$P/st.log" 2>&1
echo "steps exit $?" >> "$OUT/env.txt"; grep -E "executor (attention|experts):|attention dispatch:|send post|recv post" "$P/st.log" | tail -12 > "$OUT/steps.txt"
grep "^| streaming" "$P/st/ep_bench.md" | cut -c1-200; cat "$OUT/steps.txt"
