"""How the virtual-clock simulation's host time grows with the cluster: the streaming engine on N in-process ranks
with the model-free executor (runtime/executors/sim_executor.py), decode-only, every request arriving at once.
Prints the virtual tokens/s (the simulated cluster's) and the wall time this host took to simulate it.

    python benchmarks/sim_scale.py --ranks 64 --per-rank 8 --new-tokens 8 --model gpt-oss-120b
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graph_ir.spec import load_spec  # noqa: E402
from lab.decode_only import decode_only  # noqa: E402
from lowering.plan import compile_plan  # noqa: E402
from runtime.core.requests import Request  # noqa: E402
from runtime.drivers.cluster import Cluster, RunOptions  # noqa: E402
from runtime.executors.sim_executor import SimExecutor  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--per-rank", type=int, default=8, help="requests per rank")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--model", default="tiny", help="a shipped spec name")
    args = p.parse_args()
    spec = load_spec(ROOT / "models" / "specs" / f"{args.model}.yaml")
    # cuda: a plan beyond the CPU's 64 ranks; the memory is ample so every published model fits one rank
    plan = compile_plan(spec, args.ranks, device="cuda", device_memory_gib=1e4)
    g = random.Random(0)
    reqs = [Request(i, f"r{i}", [g.randrange(3, spec.vocab_size) for _ in range(g.randint(8, 64))], args.new_tokens,
                    ignore_eos=True, arrival=0.0) for i in range(args.ranks * args.per_rank)]
    t = time.perf_counter()
    res = Cluster(plan, SimExecutor.for_spec(spec),
                  RunOptions(executor="sim", clock="virtual", kv_blocks=4096, engine_setup=decode_only)).run(reqs)
    wall = time.perf_counter() - t
    print(f"{args.model} ranks={args.ranks} requests={len(reqs)} tokens={res.metrics['tokens']} "
          f"virtual tok/s={res.metrics['tokens_per_s']:.0f} wall {wall:.1f} s "
          f"({1e3 * wall / max(res.metrics['tokens'], 1):.2f} ms per token)")


if __name__ == "__main__":
    main()
