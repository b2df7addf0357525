"""Where gpu_bench's bf16 teacher-forced logits differ most from the fp32 reference (tiny-gpt-oss, router x30,
gpu_bench's 12 requests), by each of the CUDA executor's prompt paths (CudaExecutor.prompts), in one process: the five
largest (request, step) differences each, with the request's prompt length, and the largest per step. Run 138's
question: why separate batches put 8 rows of gpu_bench's correctness over tolerance on the H200 (runs 136-137) and not
on the CPU (the separate batches, DATAFLOW_SEPARATE_PREFILL, are gone since session 17). Each difference is marked '*'
where the step is a router near-tie (gpu_bench._router_near_ties), which gpu_bench leaves out."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gpu_bench import BF16_ROUTER_SCALE, ROOT, TeacherForcing, _reference, detach_all, sharp_router  # noqa: E402

from graph_ir.spec import load_spec  # noqa: E402
from lowering.plan import compile_plan  # noqa: E402
from models.sampling import SamplingParams  # noqa: E402
from models.weights import random_weights  # noqa: E402
from runtime.drivers.cluster import Cluster, RunOptions  # noqa: E402
from runtime.executors.cuda_executor import PROMPT_PATHS, CudaExecutor  # noqa: E402
from runtime.core.requests import Request  # noqa: E402

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
spec = load_spec(ROOT / "models/specs/tiny-gpt-oss.yaml")
rng = random.Random(0)
reqs_t = [([rng.randrange(3, spec.vocab_size) for _ in range(rng.choice([1, 1, 3, 12, 40]))], 8) for _ in range(12)]
w32 = sharp_router(random_weights(spec), BF16_ROUTER_SCALE)
refs, near, err16, mx = _reference(spec, w32, reqs_t)
plan = compile_plan(spec, 2, dev.type)
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
ex = CudaExecutor(spec, w32.to(device=dev, dtype=dtype), plan, dev)
print(f"max|logit| {mx:.3f}; CPU bf16 err {err16:.4f}")
for path in PROMPT_PATHS:
    ex.prompts = path
    tf = TeacherForcing(ex, {i: list(r.tokens) for i, r in enumerate(refs)})
    treqs = [Request(i, f"t{i}", list(p), len(refs[i].tokens), ignore_eos=True, arrival=0.0,
                     params=SamplingParams(seed=i)) for i, (p, _) in enumerate(reqs_t)]
    cl = Cluster(plan, tf, RunOptions(policy="defrag", kv_blocks=256))
    cl.run(treqs)
    detach_all(ex, cl)
    diffs = sorted(((float((tf.recorded[(i, s)] - refs[i].logits[s].float()).abs().max()) / mx, i, s)
                    for i in range(len(refs)) for s in range(len(refs[i].tokens))), reverse=True)
    print(f"prompts={path}: top diffs (ratio, request, step, prompt length, near-tie):",
          [(round(d, 4), i, s, len(reqs_t[i][0]), "*" if near[i] and near[i][s] else "") for d, i, s in diffs[:6]])
    per_step = {}
    for d, i, s in diffs:
        per_step[s] = max(per_step.get(s, 0.0), d)
    print("  max per step:", {s: round(v, 4) for s, v in sorted(per_step.items())})
