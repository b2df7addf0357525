#!/usr/bin/env bash
# Device run 22 (nvidia-h200-x2, ~7 minutes): the direct NCCL p2p path (runtime/transport/nccl_lib.py,
# DATAFLOW_NCCL_P2P=lib) against torch.distributed's isend/irecv (c10d): (1) its GPU tests, (2) the
# transport bench both ways with the step timers, (3) gpu_ep_bench (20B-L8, bf16, C=256, 64-128 new
# tokens, clean / delay / clean) with lib (+ ag-ep) and with c10d, rank phase timers on.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; git log --oneline | head -1 >> "$OUT/env.txt" 2>/dev/null
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_transport_dist.py tests/test_transport_nccl_lib.py \
  -k "cuda_exchange_direct_nccl or nccl_lib" > "$OUT/pytest.txt" 2>&1; echo "pytest exit $?" | tee -a "$OUT/env.txt"; tail -5 "$OUT/pytest.txt"
for m in lib c10d; do
  DATAFLOW_NCCL_P2P=$m DATAFLOW_PROFILE_TRANSPORT=1 timeout 90 python3 -m dataflow transport-bench --device cuda --ranks 2 \
    --sizes 0,4K,184K,1M --messages 500 > "$OUT/transport_$m.txt" 2>&1; echo "transport $m exit $?" | tee -a "$OUT/env.txt"
  grep -E "^\||send post|recv post" "$OUT/transport_$m.txt" | head -14
done
P=$(mktemp -d /tmp/run22.XXXX)
SYS="streaming-defrag:hold_fill=1;hold_us=30000,streaming-defrag"
COMMON="--scenarios clean,delay,clean --concurrency 256 --new-tokens 64:128"
for m in lib c10d; do
  extra=""; [ $m = lib ] && extra=",ag-ep"
  mkdir -p "$P/$m"
  DATAFLOW_NCCL_P2P=$m DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/$m/rank{rank}.prof" \
    timeout 200 python3 benchmarks/gpu_ep_bench.py --out "$P/$m" --budget 190 --systems "$SYS$extra" $COMMON > "$OUT/ep_$m.log" 2>&1
  echo "ep $m exit $?" | tee -a "$OUT/env.txt"; cp "$P/$m/ep_bench.md" "$OUT/ep_$m.md"; grep "^|" "$OUT/ep_$m.md"
  for r in 0 1; do cp "$P/$m/rank$r.prof.phases.txt" "$OUT/phases_${m}_rank$r.txt" 2>/dev/null; done
  head -14 "$OUT/phases_${m}_rank0.txt"
done
