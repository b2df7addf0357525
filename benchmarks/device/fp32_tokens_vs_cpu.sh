#!/usr/bin/env bash
# Called by gpu_checks.sh: `bash benchmarks/device/fp32_tokens_vs_cpu.sh OUT POLICY...`
# (from the repository root, after start.sh). For each policy a 2-GPU fp32 `dataflow run` (CUDA executor,
# NCCL, one process per rank) must give the tokens of the in-process CPU run of the same plan and requests with the
# same dispatch (a cuda plan's default, device-routed: the CPU plan is compiled with --dispatch device); the
# host-routed CPU run is compared too, for the record (since session 10 the device-routed combine adds the holders'
# partial sums, another order of fp32 additions: tokens may differ where two logits nearly tie).
# Output: OUT/tokens.txt, "requests equal to the CPU run n/12" lines per policy.
set -u
OUT=$(cd "${1:?out dir}" && pwd); shift
R=$(mktemp -d /tmp/fp32tok.XXXX); cd "$R"
python3 -m dataflow compile tiny --ranks 2 --device cuda -o plan_gpu >/dev/null 2>&1
python3 -m dataflow compile tiny --ranks 2 --device cpu --dispatch device -o plan_cpu >/dev/null 2>&1
python3 -m dataflow compile tiny --ranks 2 --device cpu --dispatch host -o plan_cpu_host >/dev/null 2>&1
{
for pol in "$@"; do
  timeout 40 python3 -m dataflow run plan_cpu --in-process -q --num-requests 12 --max-new-tokens 24 --ignore-eos --policy "$pol" -o cpu.jsonl 2>&1 | grep -E "tokens/s"
  timeout 40 python3 -m dataflow run plan_cpu_host --in-process -q --num-requests 12 --max-new-tokens 24 --ignore-eos --policy "$pol" -o cpu_host.jsonl 2>&1 | grep -E "tokens/s"
  timeout 60 python3 -m dataflow run plan_gpu -q --num-requests 12 --max-new-tokens 24 --ignore-eos --policy "$pol" --procs-timeout 50 -o gpu.jsonl 2>&1 | grep -v 'ProcessGroupNCCL' | grep -E "error|Error|tokens/s|processes" | head -4
  python3 - cpu.jsonl cpu_host.jsonl gpu.jsonl "$pol" <<'PY'
import json, os, sys
ld = lambda p: {r["id"]: r["output_token_ids"] for r in map(json.loads, open(p))} if os.path.exists(p) else None
a, h, b = ld(sys.argv[1]), ld(sys.argv[2]), ld(sys.argv[3])
eq = lambda ref: "MISSING" if b is None or ref is None else f"{sum(ref[k] == b.get(k) for k in ref)}/{len(ref)}"
print(f"2-GPU NCCL fp32 run ({sys.argv[4]}): requests equal to the CPU run {eq(a)} (same dispatch, device-routed); "
      f"to the host-routed CPU run {eq(h)}")
PY
  rm -f gpu.jsonl cpu.jsonl cpu_host.jsonl
done
} > "$OUT/tokens.txt" 2>&1
cat "$OUT/tokens.txt"
