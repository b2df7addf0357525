"""Cold start of `dataflow run` (issue 31): where the seconds before the first token go.

    python benchmarks/startup_bench.py                      # a GPU visible: GPT-OSS-20B, 1 rank, cuda; else tiny on cpu
    python benchmarks/startup_bench.py --spec models/specs/gpt-oss-20b.yaml --ranks 1 --device cuda --runs 2

Each run compiles the plan (`dataflow compile SPEC --ranks R --device D`), then times a short `dataflow run` of it as
a user starts it (a fresh process, `python -m dataflow run PLAN --prompts ... -o ...`): request 0 asks for one new
token, the others for --max-new-tokens, all arriving at once, so the moment request 0's output line appears is the
first token. The rank processes print their start-up phases (the verbose option: runtime/drivers/rank_node.py
STARTUP_PHASES, the same dict as the run's metrics["startup_s"]) and the wall clock at which they began serving. Printed
per run: the phases (the slowest rank's, and each rank's with --ranks > 1), the launcher's own time before it spawned
the ranks (the CLI's imports, the plan, the workload), the wall time to serving and to the first token, the total.
With a GPU, the CUDA executor's capture line (graphs per kind) is printed too. Run 1 uses an empty Triton cache
(TRITON_CACHE_DIR in a temporary directory: a fresh machine); later runs reuse it (a restart).

--check (default with a GPU): after the timed runs, random weights built on the GPU must equal the CPU build bit for
bit (tests/test_startup_phases.py), and the 1-GPU fp32 `dataflow run` of `tiny` must give the in-process CPU run's
tokens (the weights' values reach both runs the same way).

--json FILE writes every number. No third-party imports here besides what the repository uses; torch only in
subprocesses (this process holds no CUDA context while the runs are timed).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STARTUP_RE = re.compile(r"rank (\d+): startup of workload 0 (\{.*\}) serving_at ([0-9.]+)")


def gpu_visible() -> bool:
    code = "import torch; print(torch.cuda.is_available())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    except subprocess.TimeoutExpired:
        return False
    return out.stdout.strip().endswith("True")


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def dataflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "dataflow", *args]


def write_prompts(path: Path, spec_path: str, n: int, max_new: int, seed: int = 0) -> None:
    """n requests of 16-64 prompt tokens; request 0 asks for one new token (its line marks the first token)."""
    from graph_ir.spec import load_spec
    vocab = load_spec(spec_path).vocab_size
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))]
            f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": prompt, "max_new_tokens": 1 if i == 0 else max_new})
                    + "\n")


def compile_plan(spec: str, ranks: int, device: str, out: Path, extra: tuple = ()) -> float:
    t = time.perf_counter()
    res = subprocess.run(dataflow("compile", spec, "--ranks", str(ranks), "--device", device, "-o", str(out), *extra),
                         capture_output=True, text=True, env=_env(), cwd=out.parent)
    if res.returncode != 0:
        sys.exit(f"dataflow compile failed:\n{res.stdout}\n{res.stderr}")
    return time.perf_counter() - t


def timed_run(plan: Path, prompts: Path, work: Path, timeout: float, env: dict) -> dict:
    """One `dataflow run`: wall times (from the command's start) and the ranks' start-up reports."""
    out = work / "out.jsonl"
    out.unlink(missing_ok=True)
    cmd = dataflow("run", str(plan), "--prompts", str(prompts), "-o", str(out), "-q", "--ignore-eos",
                   "--procs-timeout", str(timeout))
    lines: list[str] = []
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=work)
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stderr.readline, "")), daemon=True)
    reader.start()
    stdout = []
    threading.Thread(target=lambda: stdout.extend(iter(p.stdout.readline, "")), daemon=True).start()
    first_token = last_line = None
    seen = 0
    while True:
        done = p.poll() is not None
        if out.exists():
            n = out.read_text().count("\n")
            if n > seen:
                now = time.time()
                first_token = first_token or now
                last_line, seen = now, n
        if done:
            break
        if time.time() - t0 > timeout + 30:
            p.kill()
            break
        time.sleep(0.005)
    t_end = time.time()
    reader.join(5)
    ranks = {}
    for line in lines:
        m = STARTUP_RE.search(line)
        if m:
            ranks[int(m.group(1))] = dict(json.loads(m.group(2)), serving_at=float(m.group(3)))
    res = {"command": " ".join(cmd), "exit": p.returncode, "wall_s": t_end - t0, "requests_finished": seen,
           "ranks": ranks, "notes": [ln.rstrip() for ln in lines if "captured" in ln or "KV pool" in ln
                                     or "weights" in ln and "bytes" in ln]}
    if p.returncode != 0 or not ranks:
        res["stderr_tail"] = "".join(lines[-30:]) + "".join(stdout[-10:])
        return res
    serving = max(r["serving_at"] for r in ranks.values())
    spawned = min(r["serving_at"] - r["total"] for r in ranks.values())  # total counts from the launcher's spawn
    phases = [k for k in next(iter(ranks.values())) if k not in ("serving_at",)]
    res.update(phases_max={k: max(r[k] for r in ranks.values()) for k in phases},
               before_spawn_s=spawned - t0, to_serving_s=serving - t0,
               to_first_token_s=(first_token - t0) if first_token else None,
               first_token_after_serving_s=(first_token - serving) if first_token else None,
               after_last_output_s=(t_end - last_line) if last_line else None)
    return res


def report(i: int, res: dict, cold: bool) -> None:
    print(f"\n== run {i + 1} ({'cold: empty Triton cache' if cold else 'warm: Triton cache of run 1'}): exit "
          f"{res['exit']}, {res['requests_finished']} requests finished, wall {res['wall_s']:.2f} s")
    if "phases_max" not in res:
        print("no start-up report from the ranks:\n" + res.get("stderr_tail", ""))
        return
    ranks = sorted(res["ranks"])
    head = f"{'phase':<12} {'max s':>9}" + "".join(f" {'rank ' + str(r):>9}" for r in ranks if len(ranks) > 1)
    print(head)
    for k, v in res["phases_max"].items():
        print(f"{k:<12} {v:9.3f}" + "".join(f" {res['ranks'][r][k]:9.3f}" for r in ranks if len(ranks) > 1))
    print(f"{'launcher before spawning the ranks':<40} {res['before_spawn_s']:9.3f} s")
    print(f"{'wall to serving (all ranks)':<40} {res['to_serving_s']:9.3f} s")
    if res["to_first_token_s"] is not None:
        print(f"{'wall to first token':<40} {res['to_first_token_s']:9.3f} s "
              f"({res['first_token_after_serving_s']:.3f} s after serving began)")
        print(f"{'exit after the last output line':<40} {res['after_last_output_s']:9.3f} s")
    for note in res["notes"]:
        print(f"  {note}")


def check(work: Path) -> dict:
    """GPU weights == CPU weights bit for bit, and 1-GPU fp32 tokens == the in-process CPU run's."""
    out: dict = {}
    code = ("import torch\nfrom graph_ir.spec import load_spec\n"
            "from models.weights import _drawer, _fill, random_weights\n"
            "bad = []\n"
            "for name in ('tiny-gpt-oss', 'tiny-glm4-moe', 'tiny'):\n"
            f"    spec = load_spec('{ROOT}/models/specs/' + name + '.yaml')\n"
            "    a, b = random_weights(spec), random_weights(spec, device='cuda')\n"
            "    ta = [a.embed, a.final_norm, a.head] + [v for l in a.layers for v in l.values()]\n"
            "    tb = [b.embed, b.final_norm, b.head] + [v for l in b.layers for v in l.values()]\n"
            "    ok = all(torch.equal(x, y.cpu()) for x, y in zip(ta, tb))\n"
            "    print(f'{name}: {sum(t.numel() for t in ta)} values, cuda == cpu: {ok}')\n"
            "    bad += [] if ok else [name]\n"
            "n = (1 << 24) + 1000  # past one device chunk\n"
            "for dt in (torch.bfloat16, torch.float32):\n"
            "    x, y = torch.empty(n, dtype=dt), torch.empty(n, dtype=dt, device='cuda')\n"
            "    for t in (x, y):\n"
            "        _fill(t, (12345, 67890), 'q.w', 0.02, _drawer(t.device))\n"
            "    ok = torch.equal(x, y.cpu())\n"
            "    print(f'one tensor of {n} values, {dt}: cuda == cpu: {ok}')\n"
            "    bad += [] if ok else [str(dt)]\n"
            "raise SystemExit(1 if bad else 0)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=600)
    out["weights"] = res.stdout.strip() or res.stderr[-2000:]
    out["weights_equal"] = res.returncode == 0
    print(f"\n== check: random weights built on the GPU vs on the CPU\n{out['weights']}")
    d = work / "check"
    d.mkdir(exist_ok=True)
    tiny = str(ROOT / "models/specs/tiny.yaml")
    compile_plan(tiny, 1, "cuda", d / "plan_gpu")
    compile_plan(tiny, 1, "cpu", d / "plan_cpu", ("--dispatch", "device"))
    write_prompts(d / "prompts.jsonl", tiny, 12, 24, seed=1)
    outs = {}
    for name, extra in (("cpu", ["--in-process"]), ("gpu", [])):
        r = subprocess.run(dataflow("run", str(d / f"plan_{name}"), "--prompts", str(d / "prompts.jsonl"), "-q",
                                    "--ignore-eos", "-o", str(d / f"{name}.jsonl"), *extra),
                           capture_output=True, text=True, env=_env(), cwd=d, timeout=300)
        if r.returncode != 0:
            out[f"{name}_error"] = r.stderr[-2000:]
        path = d / f"{name}.jsonl"
        outs[name] = {x["id"]: x["output_token_ids"] for x in map(json.loads, path.read_text().splitlines())} \
            if path.exists() else {}
    same = sum(outs["cpu"].get(k) == v for k, v in outs["gpu"].items())
    out["tokens_equal"] = f"{same}/{len(outs['cpu'])}"
    print(f"== check: tiny fp32, 1-GPU `dataflow run` vs in-process CPU run: requests with equal tokens "
          f"{out['tokens_equal']}" + "".join(f"\n{k}: {v}" for k, v in out.items() if k.endswith("_error")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", help="spec YAML (default: gpt-oss-20b with a GPU, tiny without)")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when a GPU is visible")
    ap.add_argument("--runs", type=int, default=2, help="timed runs of the same plan (run 1: empty Triton cache)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds per run")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                    help="GPU weights == CPU weights, 1-GPU tokens == CPU tokens (default: on with a GPU)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args()
    gpu = gpu_visible()
    device = a.device or ("cuda" if gpu else "cpu")
    spec = a.spec or str(ROOT / "models/specs" / ("gpt-oss-20b.yaml" if device == "cuda" else "tiny.yaml"))
    work = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    triton_cache = work / "triton-cache"
    results: dict = {"spec": spec, "ranks": a.ranks, "device": device, "gpu_visible": gpu,
                     "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "runs": []}
    try:
        plan = work / "plan"
        results["compile_s"] = compile_plan(spec, a.ranks, device, plan)
        print(f"spec {spec}, {a.ranks} rank(s), {device}{'' if gpu else ' (no GPU visible)'}; "
              f"`dataflow compile` {results['compile_s']:.2f} s")
        prompts = work / "prompts.jsonl"
        write_prompts(prompts, spec, a.requests, a.max_new_tokens)
        for i in range(a.runs):
            env = _env(DATAFLOW_OPTIONS='{"verbose": true}', TRITON_CACHE_DIR=str(triton_cache))
            res = timed_run(plan, prompts, work, a.timeout, env)
            results["runs"].append(res)
            report(i, res, cold=i == 0)
        if a.check if a.check is not None else gpu:
            results["check"] = check(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"\nwrote {a.json}")


if __name__ == "__main__":
    main()
