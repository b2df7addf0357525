#!/usr/bin/env bash
# Device run 27 (nvidia-h200-x2, ~9 minutes), session 4: the merge by dispatch position (expert outputs
# received in place, combine through row_index; commit 9e4addb).
# (1) GPU tests: the 2-rank CUDA exchange (now also receiving every third tensor in place, direct NCCL and
#     c10d) and the CUDA executor tests; (2) fp32 2-GPU tokens == CPU tokens (defrag, defrag + hold);
# (3) A/B old tree (1b08f1b, before the change; carried as .df/ab/old_1b08f1b.tgz, carry [".whl", ".df/ab"])
#     vs this tree: streaming/defrag + 30 ms hold, GPT-OSS-20B cut to 8 layers, bf16, C=256, clean,
#     alternating launches, 2 rounds each, rank-0 phase timers.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; git log -1 --format=%H >> "$OUT/env.txt" 2>/dev/null
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_transport_dist.py tests/test_executor_cuda.py \
  -k "cuda" > "$OUT/pytest.txt" 2>&1; echo "pytest exit $?" | tee -a "$OUT/env.txt"; tail -3 "$OUT/pytest.txt"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000"
OLD=/tmp/old_tree; mkdir -p $OLD && tar -xzf .df/ab/old_1b08f1b.tgz -C $OLD
NEW=$PWD
P=$(mktemp -d /tmp/run27.XXXX)
ARGS=(--budget 120 --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128)
for r in 1 2; do
  for v in old new; do
    T=$NEW; [ $v = old ] && T=$OLD
    mkdir -p "$P/$v$r"
    (cd $T && PYTHONPATH=/tmp/site:$T DATAFLOW_PROFILE_RANK=0 DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/$v$r/rank{rank}.prof" \
      timeout 130 python3 benchmarks/gpu_ep_bench.py --out "$P/$v$r" "${ARGS[@]}" > "$OUT/ep_$v$r.log" 2>&1)
    echo "$v round $r exit $?" | tee -a "$OUT/env.txt"; cp "$P/$v$r/ep_bench.md" "$OUT/ep_$v$r.md"; grep "^| streaming" "$OUT/ep_$v$r.md"
    cp "$P/$v$r/rank0.prof.phases.txt" "$OUT/phases_$v${r}_rank0.txt" 2>/dev/null; head -30 "$OUT/phases_$v${r}_rank0.txt" | grep -E "execute|complete|feed|send|poll|batch"
  done
done
