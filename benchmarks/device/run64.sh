#!/usr/bin/env bash
# Device run 64 (nvidia-h200-x2, TWO GPUs, ~8 minutes): written in session 8 for the next session with two GPUs (session
# 8 had one; it replaces run 55). One process per GPU over NCCL, GPT-OSS-20B cut to 8 layers, bf16, C=256, clean:
# (1) the 2-rank CUDA transport tests and fp32 2-GPU tokens == CPU (defrag, defrag + hold);
# (2) sessions 7-8's host-path changes in the 2-process setting: this tree against 1508b2a (before session 7's host
#     changes: numpy routing read, cached views, bounded waits; and session 8's: numba dispatch plan, upload in one
#     .to(), stream-order slots, probe events made up front), streaming/defrag + 30 ms hold, 3 rounds with the
#     checked method (ab_trees.sh: both trees from /tmp copies, order swapped every round);
# (3) polling waits against the blocking wait in one tree (--variants poll / sync = DATAFLOW_DEVICE_WAIT_S=inf;
#     NOTES §22 item 11, §23 item 7), 2 rounds, with all-gather EP for the ratio, host us both ways and GPU busy.
# Before the call: mkdir -p .df/ab && git archive 1508b2a | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, tokens.txt, ab.txt, phases.txt, wait.md. Then `python benchmarks/ab_phases.py` does not apply
# (2-process phases); compare complete:attn and execute:attn per call in phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/gpu_checks.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000"
AB_TIMEOUT=100 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 3 --budget 90 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128
P=$(mktemp -d /tmp/run64.XXXX)
timeout 200 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 190 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --variants "poll:DATAFLOW_DEVICE_WAIT_S=300;sync:DATAFLOW_DEVICE_WAIT_S=inf" \
  --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "wait A/B exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/wait.md"; grep "^| " "$OUT/wait.md" | grep -v "^|---" | cut -c1-230
