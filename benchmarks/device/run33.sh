#!/usr/bin/env bash
# Device run 33 (nvidia-h200-x2, ~3 minutes), session 4: hold_ahead (homes announce their wave one layer ahead so an
# owner's expert stage holds one home's wave for the other's) vs the plain wave hold, streaming/defrag, 30 ms bound,
# GPT-OSS-20B cut to 8 layers, bf16, C=256 (round-robin homes), clean twice in one launch (A B A B).
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run33.XXXX)
timeout 230 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 220 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,streaming-defrag:hold_fill=1;hold_us=30000;hold_ahead=1" \
  --scenarios clean,clean --concurrency 256 --new-tokens 64:128 > "$OUT/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; cp "$P/ep_bench.json" "$OUT/ep.json"
grep "^| streaming" "$OUT/ep.md" | cut -c1-220
python3 -c "
import json; d=json.load(open('$OUT/ep.json'))
for r in d['runs']: print(r['name'], 'attn batches', r.get('attn_batches'), 'expert batches', r.get('expert_batches'), 'tok/s', round(r['tokens_per_s']))"
