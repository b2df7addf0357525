#!/usr/bin/env bash
# Device run 109 (nvidia-h200-x2, TWO GPUs, ~8 minutes): session 14's first host cuts (NOTES §31): a decode wave's
# lists move through its layers as they are (the batch's segments made once per step, the CUDA executor's table-row
# lookup once per step), a whole merge group forwards its own lists, device-routed expert outputs carry their run tags
# as is. (1) gpu_bench correctness on GPU 0; (2) fp32 2-GPU tokens == CPU under the hold; (3) A/B against e335aa9
# (session 13's last runtime), 20B-L8, bf16, C=512, clean, streaming/defrag + 30 ms hold, 3 rounds, both trees' phases;
# (4) one launch of this tree with the executor's and the dispatch's laps (DATAFLOW_PROFILE_EXEC=1).
# Before the call: mkdir -p .df/ab && git archive e335aa9 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, gpu_bench.md, tokens.txt, ab.txt, phases.txt, laps.log.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
AB_TIMEOUT=75 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 3 --budget 60 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 512 --new-tokens 64:128
P=$(mktemp -d /tmp/run109.XXXX)
DATAFLOW_PROFILE_EXEC=1 timeout 75 python3 benchmarks/gpu_ep_bench.py --out "$P/l" --budget 60 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 512 --new-tokens 64:128 \
  > "$P/laps.log" 2>&1
echo "laps exit $?" | tee -a "$OUT/env.txt"
grep -E "attention (execute|dispatch)|executor (attention|experts)|^\| streaming" "$P/laps.log" | cut -c1-700 > "$OUT/laps.log"
cut -c1-150 "$OUT/ab.txt"
grep -E "^===|complete:attn|execute:attn|next_batch|feed" "$OUT/phases.txt" | head -60
