#!/usr/bin/env bash
# matrix.yaml checks-2gpu: `bash benchmarks/device/gpu_checks.sh OUT POLICY...`
# (from the repository root, after start.sh). The 2-rank CUDA transport tests (one "pytest exit" line appended
# to OUT/env.txt) and, per policy, the fp32 2-GPU tokens against the CPU run (fp32_tokens_vs_cpu.sh; OUT/tokens.txt).
set -u
OUT=$(cd "${1:?out dir}" && pwd); shift
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_transport_dist.py -k "cuda" > "$OUT/env.txt.pytest" 2>&1
echo "pytest exit $?: $(tail -1 "$OUT/env.txt.pytest")" | tee -a "$OUT/env.txt"; rm -f "$OUT/env.txt.pytest"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "$@" | grep "2-GPU"
