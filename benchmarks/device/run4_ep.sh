#!/usr/bin/env bash
# Device run 4 (nvidia-h200-x2, < 9 minutes): streaming (defrag, aging) vs all-gather EP vs all-to-all EP,
# one process per GPU, real NCCL collectives for the baselines (lab/barrier_dist.py), GPT-OSS-20B
# cut to 8 layers, bf16, decode-only, Zipf routing, C = 64 and 256 requests per rank, scenarios clean,
# delay bursts, compute hog on GPU 1, NVLink hog (benchmarks/gpu_ep_bench.py).
# Output under $1 (4 files): env.txt, ep_bench.log, ep_bench.json, ep_bench.md.
# Usage: bash benchmarks/device/run4_ep.sh $OUT [extra gpu_ep_bench.py flags]   (device tool: carry [".whl"])
# CPU dry run: sed '/pip install/d' benchmarks/device/run4_ep.sh | bash -s -- /tmp/run4 --smoke
set -u
OUT=${1:?out dir}; shift
. benchmarks/device/prelude.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
{ date -u; git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv 2>&1;
  nvidia-smi topo -m 2>&1 | head -5; python3 -c 'import torch;print("torch",torch.__version__,"cuda",torch.cuda.is_available(),torch.cuda.device_count())'; } 2>&1 | tee "$OUT/env.txt"
timeout -k 10 ${EP_TIMEOUT:-530} python3 benchmarks/gpu_ep_bench.py --out "$OUT" --budget ${EP_BUDGET:-480} "$@" 2>&1 | tee "$OUT/ep_bench.log" | grep -v '^\[rank [01]\]   File\|^\[rank [01]\]     '
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt"
# no orphans: hog processes exit with their parent; show anything still on the GPUs
nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv 2>&1 | tee -a "$OUT/env.txt"
