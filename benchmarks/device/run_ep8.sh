#!/usr/bin/env bash
# Issue 8's run (nvidia-h200-x8, EIGHT GPUs, ~9.5 minutes per call): `bash benchmarks/device/run_ep8.sh OUT LENGTHS`
# with LENGTHS = sharegpt or gsm8k (one call each; carry [".whl"]). Written in session 9 and smoke-tested on the
# CPU only (8 gloo ranks, the tiny model, gsm8k, both dispatches, delay on one link: 32/32 requests equal to
# all-gather EP; benchmarks/results/session9_cpu_checks.md, again after session 10's partial sums:
# session10_cpu_checks.md); no 8-GPU kind has been lent yet.
# GPT-OSS-120B at full depth (36 layers) in bf16, EP8 with attention data-parallel on all eight (each rank holds 16 of
# the 128 experts per layer: 30.7 GiB of weights, `dataflow compile gpt-oss-120b --ranks 8 --device cuda`),
# C=64 per rank, prompts of LENGTHS clipped to 1024, 32-64 new tokens, decode-only. Streaming (defrag + 30 ms hold)
# with both dispatches as variants (the device-routed one sends every attention batch whole to all 8 holders where
# a token's 4 experts sit on ~3.3 of them: ~2.4x the bytes of the host-routed one out, 2x back since session 10's
# per-token partial sums, and expert batches whose slots are ~1/8 this rank's: which dispatch wins at EP8 is a
# question this run answers; benchmarks/NOTES.md §26 item 11, §27 item 4), against all-gather and
# all-to-all EP; clean, compute hog on GPU 1, +5 ms bursts on the link 0-1 only (one slow link among 28), NVLink hog
# between GPUs 0 and 1. 1 round. Output: env.txt, ep.md (tok/s, ratios, ITL p50/p99, batch sizes, host us, GB/s).
# Attention cap 256 (session 13 made the default 1,024): C=64 per rank never needs more, and at 8 ranks the default's
# device-routed expert cap would be 8 x 1,024 x 4 = 32,768 slots, ~700 graphs per rank to capture per launch, which
# this call's time budget was not planned for.
set -u
OUT=${1:?out dir}; LENGTHS=${2:?sharegpt or gsm8k}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
nvidia-smi --query-gpu=index,name,memory.total --format=csv >> "$OUT/env.txt" 2>&1
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/ep8.XXXX)
timeout 560 python3 benchmarks/gpu_ep_bench.py --out "$P" --model gpt-oss-120b --layers 36 --ranks 8 --lengths "$LENGTHS" \
  --budget 550 --attn-cap 256 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep,a2a-ep" \
  --variants "host:DATAFLOW_DISPATCH=host;device:DATAFLOW_DISPATCH=device" \
  --scenarios clean,compute-hog,delay-5ms,nvlink-hog --delay-links 0-1 --hog-device 1 --concurrency 64 \
  --new-tokens 32:64 > "$P/ep.log" 2>&1
echo "ep8 $LENGTHS exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md" 2>/dev/null
grep "^| " "$OUT/ep.md" | grep -v "^|---" | cut -c1-240; grep -i "failed\|timed out\|error" "$P/ep.log" | head -5 >> "$OUT/env.txt"
tail -n 5 "$P/ep.log" >> "$OUT/env.txt"
