"""A decode step's sampling, batched on the logits' device (models.sampling.sample_tokens, session 16) against the
per-row host path it replaced (each row's logits to the CPU, filtered there, one torch.multinomial per row with a
CPU generator), side by side in one run: milliseconds per sample batch and the ratio.

    python benchmarks/sampling_bench.py                       # the CUDA device if there is one, else the CPU
    python benchmarks/sampling_bench.py --vocab 201088 --rows 1,64,256 --reps 5

The per-row path's time grows with the rows (4-22 ms per 201k-token row on this repository's CPU); it runs
`--old-reps` times only. The tokens differ between the two (another random stream); each path is checked to be
deterministic and to draw only tokens the filters keep, and on a GPU the batched tokens are compared with the same
draw on the CPU (the same integer hash; `log`, `softmax` and `cumsum` may round differently in the last bit).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.sampling import SamplingParams, filtered_probs, sample_tokens, step_seed  # noqa: E402

CONFIGS = {
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50),
}


def _old_row(logits_row: torch.Tensor, p: SamplingParams, step: int) -> int:
    """The pre-session-16 sampler of one row: to the host, filtered there, multinomial with a CPU generator."""
    probs = filtered_probs(logits_row.to("cpu"), p)
    g = torch.Generator(device="cpu").manual_seed(step_seed(p.seed, step))
    return int(torch.multinomial(probs, 1, generator=g))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, reps: int) -> float:
    fn()  # warm-up (allocator, kernels)
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / reps * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=201088, help="GPT-OSS's vocabulary by default")
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--old-reps", type=int, default=1)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"vocab {args.vocab}, logits bf16; ms per sample batch (all rows sampling), tokens to the host included")
    print("| rows | filter | batched on the device | per row on the host | speedup | tokens equal to the CPU's |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator(device="cpu").manual_seed(0)
    failed = 0
    for B in [int(x) for x in args.rows.split(",")]:
        logits = (torch.randn(B, args.vocab, generator=g) * 3).to(device, torch.bfloat16)
        for name, base in CONFIGS.items():
            params = [base.model_copy(update={"seed": i}) for i in range(B)]
            steps = list(range(B))
            new = sample_tokens(logits, params, steps).tolist()
            if new != sample_tokens(logits, params, steps).tolist():
                failed += 1
                print(f"  {B} rows, {name}: not deterministic")
            kept = [bool(filtered_probs(logits[i].float().cpu(), params[i])[t] > 0) for i, t in enumerate(new)]
            if not all(kept):
                failed += 1
                print(f"  {B} rows, {name}: {kept.count(False)} tokens outside the filter")
            t_new = _time(lambda: sample_tokens(logits, params, steps).tolist(), device, args.reps)
            t_old = _time(lambda: [_old_row(logits[i], params[i], steps[i]) for i in range(B)], device, args.old_reps)
            same = "-"
            if device.type != "cpu":  # the same draw on the CPU: equal but where rounding splits a near-tie
                cpu = sample_tokens(logits.cpu(), params, steps).tolist()
                same = f"{sum(a == b for a, b in zip(new, cpu))}/{B}"
            print(f"| {B} | {name} | {t_new:.2f} | {t_old:.1f} | {t_old / t_new:.2f}x | {same} |", flush=True)
    print(f"{failed} failed checks")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
