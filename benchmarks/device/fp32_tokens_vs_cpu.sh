#!/usr/bin/env bash
# Helper of the correctness runs (15, 25): `bash benchmarks/device/fp32_tokens_vs_cpu.sh OUT POLICY...`
# (from the repository root, after prelude.sh). For each policy a 2-GPU fp32 `dataflow run` (CUDA executor,
# NCCL, one process per rank) must give the tokens of the in-process CPU run of the same plan and requests.
# Output: OUT/tokens.txt, one "requests equal to the CPU run n/12" line per policy.
set -u
OUT=$(cd "${1:?out dir}" && pwd); shift
R=$(mktemp -d /tmp/fp32tok.XXXX); cd "$R"
python3 -m dataflow compile tiny --ranks 2 --device cuda -o plan_gpu >/dev/null 2>&1
python3 -m dataflow compile tiny --ranks 2 --device cpu -o plan_cpu >/dev/null 2>&1
{
for pol in "$@"; do
  timeout 40 python3 -m dataflow run plan_cpu --in-process -q --num-requests 12 --max-new-tokens 24 --ignore-eos --policy "$pol" -o cpu.jsonl 2>&1 | grep -E "tokens/s"
  timeout 60 python3 -m dataflow run plan_gpu -q --num-requests 12 --max-new-tokens 24 --ignore-eos --policy "$pol" --procs-timeout 50 -o gpu.jsonl 2>&1 | grep -v 'ProcessGroupNCCL' | grep -E "error|Error|tokens/s|processes" | head -4
  python3 - cpu.jsonl gpu.jsonl "$pol" <<'PY'
import json, os, sys
ld = lambda p: {r["id"]: r["output_token_ids"] for r in map(json.loads, open(p))} if os.path.exists(p) else None
a, b = ld(sys.argv[1]), ld(sys.argv[2])
print(f"2-GPU NCCL fp32 run ({sys.argv[3]}): " + ("MISSING" if b is None else f"requests equal to the CPU run {sum(a[k] == b.get(k) for k in a)}/{len(a)}"))
PY
  rm -f gpu.jsonl cpu.jsonl
done
} > "$OUT/tokens.txt" 2>&1
cat "$OUT/tokens.txt"
