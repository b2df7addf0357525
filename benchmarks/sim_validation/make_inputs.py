"""Writes the simulator validation's inputs (benchmarks/results/sim_validation.md): GPT-OSS-20B cut to 8 layers as a
spec file, and the H200 runs' request lists (benchmarks/gpu_ep_bench.py make_requests with its seed: ranks x C
requests, ShareGPT prompts clipped to 1024, new tokens uniform 64..128) as prompts JSONL for the bench's workload.

    python benchmarks/sim_validation/make_inputs.py
"""
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from graph_ir.spec import cut_layers, load_spec  # noqa: E402
from gpu_ep_bench import make_requests  # noqa: E402

OUT = Path(__file__).parent


def main() -> None:
    spec = cut_layers(load_spec(ROOT / "models/specs/gpt-oss-20b.yaml"), 8)
    (OUT / "gpt-oss-20b-L8.yaml").write_text(
        "# GPT-OSS-20B cut to its first 8 layers (graph_ir.spec.cut_layers), as benchmarks/gpu_ep_bench.py runs it\n"
        + yaml.safe_dump(spec.model_dump(exclude_none=True), sort_keys=False))
    # the two-rank runs 113/114, and the one-rank barrier-host run of session 25 (benchmarks/results/h200/README.md)
    for ranks, C in ((2, 256), (2, 512), (1, 256), (1, 512)):
        reqs = make_requests(spec, C * ranks, 0 + C, 1024, 64, 128)  # gpu_ep_bench: seed + C, --max-prompt, --new-tokens
        name = f"h200_C{C}" if ranks == 2 else f"h200_1rank_C{C}"
        with open(OUT / f"{name}_requests.jsonl", "w") as f:
            for q in reqs:
                f.write(json.dumps({"id": q.name, "prompt_token_ids": q.prompt, "max_new_tokens": q.max_new_tokens})
                        + "\n")
        print(f"{name}: {len(reqs)} requests, mean prompt {sum(len(q.prompt) for q in reqs) / len(reqs):.2f}, "
              f"{sum(q.max_new_tokens for q in reqs)} new tokens")


if __name__ == "__main__":
    main()
