"""Streaming vs all-gather EP vs all-to-all EP, one process per GPU, real NCCL collectives, clean and
under interference, in one command.

    python benchmarks/gpu_ep_bench.py --out DIR               # 2 GPUs: GPT-OSS-20B cut to 8 layers, ~6-8 min
    python benchmarks/gpu_ep_bench.py --out DIR --smoke       # CPU dry run: gloo, tiny model, fp32, < 2 min
    python benchmarks/gpu_ep_bench.py --out DIR --model gpt-oss-120b            # cut to 18 layers
    ... --systems streaming-defrag,ag-ep --scenarios clean,delay --concurrency 64 --layers 4
    ... --scenarios clean,delay-1ms,delay-5ms,delay-10ms       # sweep the burst size in one launch
    ... --rounds 3 --variants "wait0:decode_wait_ms=0;wait2:decode_wait_ms=2"   # an A/B of a RuntimeOptions field, medians of 3

Every system gets the same weights (seeded, drawn on each rank's device), placement (the plan's),
kernels (runtime/executor_cuda.CudaExecutor), KV cache, requests and routing (Zipf, keyed by
(request, position, layer): a token routes identically in every system), decode-only (random prompt
KV, ShareGPT prompt lengths clipped to --max-prompt, new tokens drawn in --new-tokens A:B), all
requests at t = 0, C requests per rank (--concurrency). Rank r runs on cuda:r.

Systems: streaming-<policy> (runtime/multiproc's RankNode over ZmqDistTransport + NCCL p2p;
lab/stream_dist.stream_rank_main), ag-ep and a2a-ep (lab/barrier_dist: per-layer
dist.all_gather_into_tensor + dist.all_reduce, or dist.all_to_all_single with sizes exchanged first).
Scenarios: clean; delay (link delay bursts: +--burst-us for --burst-duty of every --burst-period-ms,
on every link, or on the --delay-links pairs only; streaming: the transport's receive lanes (or --delay-lanes), barrier: a host stall
before each dispatch/combine collective while the burst is on); delay-<N>ms (the same bursts with
+N ms instead of --burst-us, N > 0, fractions allowed: delay-5ms, delay-10ms, delay-0.5ms; list several
to sweep the size in one launch; ep_bench.json's meta.burst.extra_us_by_scenario has each scenario's
size in us); compute-hog (a process running bf16 8192^3 matmuls in a loop on GPU 1); nvlink-hog (a
process copying 256 MB buffers GPU0 <-> GPU1 continuously). Hogs are started by rank 0 before the
workload and stopped after it (lab/hogs.py, lab/dist_scenarios.py).

One launch per system family (barrier: ag + a2a; streaming: every policy), each starting with an
unreported warm-up workload (CUDA graph capture). Output (DIR): ep_bench.json (everything, written
after each launch), ep_bench.md (the table). Progress lines carry seconds since start. Per system and
scenario the table has tok/s and its ratios, ITL p50/p99, mean batch rows, host us per attention and
expert batch with the share hidden behind the batch's own device work and behind any device work of the
rank (the paper's definition; lab/busy_timeline.py), and the expert batches' GB/s
against the measured device copy ceiling (lab/host_probe.HostProbe).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # a test loads this file by its path

from ep_bench_report import print_table, ratios, summarize, tokens_check, write_md  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s {time.strftime('%H:%M:%S')}] {msg}", flush=True)


SYSTEMS = ("streaming-defrag", "streaming-aging", "ag-ep", "a2a-ep")
SCENARIOS = ("clean", "delay", "compute-hog", "nvlink-hog")  # the default list; also delay-<N>ms
SCENARIO_FORMS = ("clean, delay (+--burst-us), delay-<N>ms (+N ms, N > 0, e.g. delay-5ms, delay-0.5ms), "
                  "compute-hog, nvlink-hog")


def delay_us_of(scenario: str, burst_us: float):
    """Extra us per burst of a delay scenario (`delay`: burst_us; `delay-<N>ms`: N * 1000); None otherwise."""
    from lab.dist_scenarios import delay_of_scenario
    s = delay_of_scenario(scenario, burst_us)
    return None if s is None else round(s * 1e6, 6)


def unknown_names(systems: list, scenarios: list) -> list:
    """The systems and scenarios the bench cannot run."""
    return [s for s in systems if not (s in ("ag-ep", "a2a-ep") or s.startswith("streaming-"))] + \
        [s for s in scenarios if s not in SCENARIOS and delay_us_of(s, 0.0) is None]


def make_requests(spec, n: int, seed: int, max_prompt: int, new_lo: int, new_hi: int, rid0: int = 0,
                  lengths: str = "sharegpt") -> list:
    """n requests: prompt lengths of the `lengths` distribution (lab/lengths.py: sharegpt, gsm8k)
    clipped to max_prompt, new tokens uniform in [new_lo, new_hi] (decode-only runs of bounded length)."""
    from lab.lengths import length_distribution
    from runtime.core.requests import Request
    sampler = length_distribution(lengths, max_prompt + 1)
    lens = sampler.sample(n, seed)
    g = random.Random(seed)
    out = []
    for i, ln in enumerate(lens):
        p = max(2, min(int(ln.prompt), max_prompt))
        out.append(Request(rid0 + i, f"r{rid0 + i}", [g.randrange(3, spec.vocab_size - 8) for _ in range(p)],
                           g.randint(new_lo, new_hi), ignore_eos=True, arrival=0.0))
    return out


def kv_blocks_for(reqs: list, block: int, ranks: int) -> int:
    need = [math.ceil(q.kv_tokens / block) for q in reqs]
    return int(math.ceil(sum(need) / ranks * 1.3)) + max(need) + 8


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU dry run: gloo, tiny model, fp32, tiny CPU hogs")
    p.add_argument("--model", default=None, help="gpt-oss-20b (default) | gpt-oss-120b")
    p.add_argument("--layers", type=int, default=None, help="cut to N layers (20b: 8, 120b: 18)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of: {SCENARIO_FORMS}")
    p.add_argument("--concurrency", default=None, help="requests per rank, comma list (default 64,256)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--home-policy", default="round_robin", choices=["round_robin", "most_free_kv"],
                   help="home rank of each request (both systems alike). round_robin: exactly C per rank. "
                        "most_free_kv (the plan default) balances KV blocks instead: 265 / 247 requests at C=256 "
                        "with ShareGPT prompts, and rank 0's 265 exceeded the then 256-row attention cap, so its every "
                        "decode step ran two attention waves (runs 27-31, NOTES §19 item 4)")
    p.add_argument("--lengths", default="sharegpt", choices=["sharegpt", "gsm8k"],
                   help="prompt-length distribution (shared/data percentiles; new tokens stay --new-tokens)")
    p.add_argument("--max-prompt", type=int, default=None, help="prompt lengths clipped here (1024)")
    p.add_argument("--new-tokens", default=None, help="A:B new tokens per request, uniform (32:64)")
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--attn-cap", type=int, default=None,
                   help="tokens per attention batch (the plan's attn_cap; default: the plan's, "
                        "lowering.plan.DEFAULT_ATTN_CAP): below C, a home's decode wave runs as several attention "
                        "batches, i.e. several waves in flight")
    p.add_argument("--expert-cap", type=int, default=None,
                   help="routed rows (slots, with the device-routed dispatch) per expert batch; also the largest captured "
                        "expert bucket (lowering/capture.py); default: the plan's (lowering.plan.default_expert_cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burst-us", type=float, default=2000.0, help="extra us per burst of the `delay` scenario "
                   "(delay-<N>ms: N ms)")
    p.add_argument("--burst-period-ms", type=float, default=20.0)
    p.add_argument("--burst-duty", type=float, default=0.3)
    p.add_argument("--delay-links", default=None,
                   help="rank pairs whose link gets the bursts, both directions, e.g. 0-1 or 0-1,2-3 (default: every "
                        "link). With 4+ ranks one slow link among several is the case the design is for (issue 8)")
    p.add_argument("--delay-lanes", default="recv", help="streaming transport lanes that get the burst: recv|send|recv,send")
    p.add_argument("--hog-device", type=int, default=1)
    p.add_argument("--hog-mb", type=int, default=256)
    p.add_argument("--hog-n", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=None, help="requests per rank of the unreported warm-up workload (default: the largest --concurrency)")
    p.add_argument("--launch-timeout", type=float, default=None, help="seconds per launch (default: from --budget)")
    p.add_argument("--budget", type=float, default=470.0, help="seconds for the whole bench")
    p.add_argument("--variants", default=None,
                   help="A/B of the streaming launches' settings: 'NAME:KEY=VALUE,...;NAME:...', KEY a RuntimeOptions "
                        "field (runtime/settings.py) or an environment variable of a library the ranks load (NCCL_ALGO) "
                        "(e.g. 'wait0:decode_wait_ms=0;wait2:decode_wait_ms=2'); rows read streaming-<policy>@NAME")
    p.add_argument("--timeline", action="store_true",
                   help="the streaming ranks also record every batch and data message: DIR/timeline_<row>.json, "
                        "read by benchmarks/wave_timeline.py")
    p.add_argument("--rounds", type=int, default=1,
                   help="launch every family this many times, variants alternating within a round, and add a "
                        "table of medians over rounds (the H200 box's run-to-run noise is 10-40%%)")
    args = p.parse_args(argv)
    try:
        variants = parse_variants(args.variants)
    except ValueError as err:
        p.error(str(err))
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")

    import torch
    gpu = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        model, layers, dtype, executor = args.model or "tiny-gpt-oss", args.layers, "float32", "cuda"
        conc = [int(c) for c in (args.concurrency or "4,8").split(",")]
        max_prompt, new = args.max_prompt or 48, args.new_tokens or "3:6"
        hog_dev: object = "cpu"
        hog_kw = dict(mb=4, n=64)
        warm = args.warmup or 2
    else:
        model = args.model or "gpt-oss-20b"
        layers = args.layers or (18 if "120b" in model else 8)
        dtype, executor = "bfloat16", "cuda"
        conc = [int(c) for c in (args.concurrency or "64,256").split(",")]
        max_prompt, new = args.max_prompt or 1024, args.new_tokens or "32:64"
        hog_dev = args.hog_device
        hog_kw = dict(mb=args.hog_mb, n=args.hog_n)
        warm = args.warmup  # default below: the largest concurrency (see warm_reqs)
        if not gpu:
            log("no GPU visible: running on CPU (gloo); use --smoke for a quick dry run")
    new_lo, new_hi = (int(x) for x in new.split(":"))
    systems = [s for s in args.systems.split(",") if s]
    scenarios = [s for s in args.scenarios.split(",") if s]
    bad = unknown_names(systems, scenarios)
    if bad:
        p.error(f"unknown system/scenario {bad}; systems: {SYSTEMS} (streaming-<policy>), scenarios: {SCENARIO_FORMS}")
    if gpu and torch.cuda.device_count() < args.ranks:
        p.error(f"{args.ranks} ranks need {args.ranks} GPUs; {torch.cuda.device_count()} visible")
    try:
        links = parse_links(args.delay_links, args.ranks)
    except ValueError as err:
        p.error(str(err))
    if not gpu:  # only once the arguments are valid: a caller's process (a test) keeps its environment
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from lowering.plan import DEFAULT_ATTN_CAP, compile_plan
    from lab.barrier_dist import ExecSpec, cut_spec
    from lab.dist_job import DistJob, Workload, run_dist
    from lab.dist_scenarios import BurstDelays
    spec = cut_spec(model, layers, dtype)
    plan = compile_plan(spec, args.ranks, "cuda" if gpu else "cpu", home_policy=args.home_policy,
                        attn_cap=args.attn_cap or DEFAULT_ATTN_CAP, expert_cap=args.expert_cap)
    es = ExecSpec(model=model, layers=layers, dtype=dtype, executor=executor, zipf_s=args.zipf, seed=args.seed,
                  max_context=max_prompt + new_hi + 32)
    delays = BurstDelays(args.burst_period_ms, args.burst_duty, args.burst_us, links=links,
                         directions=tuple(x for x in args.delay_lanes.split(",") if x))
    hogs = {"compute-hog": dict(kind="compute", device=hog_dev, **hog_kw),
            "nvlink-hog": dict(kind="nvlink", devices=(0, 1) if gpu else ("cpu", "cpu"), **hog_kw)}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    block = plan.kv.block_size
    reqs_of = {C: make_requests(spec, C * args.ranks, args.seed + C, max_prompt, new_lo, new_hi, lengths=args.lengths)
               for C in conc}
    # The warm-up runs as many requests per rank as the largest measured workload (short outputs): a
    # 16-request warm-up left the barrier's first C=256 run at half its later rate (runs 8, 13, 14:
    # first use of the large shapes), which the "vs clean" column then reported as the clean rate.
    warm = warm or max(conc)
    warm_reqs = make_requests(spec, warm * args.ranks, args.seed + 99991, max_prompt, new_lo, min(new_hi, new_lo + 4),
                              lengths=args.lengths)
    kv_of = {C: kv_blocks_for(r, block, args.ranks) for C, r in reqs_of.items()}
    kv_warm = kv_blocks_for(warm_reqs, block, args.ranks)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), command=" ".join(sys.argv), model=spec.name,
                layers=spec.num_layers, experts=spec.experts.num_experts, top_k=spec.experts.top_k, dtype=dtype,
                ranks=args.ranks, home_policy=args.home_policy, device="cuda" if gpu else "cpu", torch=torch.__version__,
                gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if gpu else [],
                concurrency_per_rank=conc, lengths=args.lengths, max_prompt=max_prompt, new_tokens=[new_lo, new_hi], zipf_s=args.zipf,
                burst=dict(extra_us=args.burst_us, period_ms=args.burst_period_ms, duty=args.burst_duty,
                           extra_us_by_scenario={sc: delay_us_of(sc, args.burst_us) for sc in scenarios
                                                 if delay_us_of(sc, args.burst_us) is not None},
                           streaming_lanes=args.delay_lanes, barrier="host stall before each dispatch/combine",
                           links="every link" if links is None else sorted(links)),
                hogs=hogs, kv_blocks_per_rank={str(C): kv_of[C] for C in conc},
                prompt_len_mean={str(C): sum(len(q.prompt) for q in r) / len(r) for C, r in reqs_of.items()})
    log(f"{spec.name} ({spec.num_layers} layers, {spec.experts.num_experts} experts top-{spec.experts.top_k}, {dtype}) "
        f"ranks={args.ranks} device={meta['device']} C/rank={conc} systems={systems} scenarios={scenarios}")
    results: dict = {"meta": meta, "runs": [], "errors": [], "hogs": []}

    def dump() -> None:
        (out_dir / "ep_bench.json").write_text(json.dumps(results, indent=1, default=str))
        write_md(out_dir / "ep_bench.md", results)

    def workloads(family: list[str], rnd: int) -> list:
        ws = [Workload(f"warmup-{family[0]}", family[0], warm_reqs, kv_warm, "clean", report=False)]
        seen: dict[str, int] = {}
        for sc in scenarios:
            # A scenario may repeat (e.g. clean first and last) to expose order effects; repeats
            # get a #n label so their rows stay apart, and rounds an .rN suffix.
            seen[sc] = seen.get(sc, 0) + 1
            label = (sc if seen[sc] == 1 else f"{sc}#{seen[sc]}") + (f".r{rnd}" if args.rounds > 1 else "")
            for C in conc:
                for s in family:
                    ws.append(Workload(f"{s}/{label}/C{C}", s, reqs_of[C], kv_of[C], sc))
        return ws

    launches = []  # (target, family, round, variant name, variant env)
    bar = [s for s in systems if s in ("ag-ep", "a2a-ep")]
    stream = [s for s in systems if s.startswith("streaming-")]
    for rnd in range(1, args.rounds + 1):
        if bar:
            launches.append(("barrier", bar, rnd, None, {}))
        for vname, venv in (variants if stream else []):
            launches.append(("stream", stream, rnd, vname, venv))
    for i, (target, family, rnd, vname, venv) in enumerate(launches):
        left = args.budget - (time.perf_counter() - T0)
        limit = args.launch_timeout or max(60.0, left / (len(launches) - i))
        ws = workloads(family, rnd)
        log(f"launch {target}{'@' + vname if vname else ''}{f' round {rnd}' if args.rounds > 1 else ''}: "
            f"{len(ws) - 1} workloads ({', '.join(family)}) + warm-up; limit {limit:.0f} s")
        job = DistJob(plan, es, ws, delays=delays, hogs=hogs, decode_only=True, peer_timeout_s=60.0 if gpu else 20.0,
                      log_t0=time.time() - (time.perf_counter() - T0), timeline=args.timeline)
        t = time.perf_counter()
        try:
            env = {"TRITON_INTERPRET": "1"} if not gpu else {}
            env.update(venv)
            res = run_dist(target, job, args.ranks, timeout=limit, env=env)
            results["hogs"].extend(res.get("hogs", []))
            for w in res["workloads"]:
                if not w["report"]:
                    log(f"  {w['name']}: warm-up done in {w['wall_s']:.1f} s")
                    continue
                s = summarize(w)
                s["workload"] = w["name"]  # as the ranks named it (tokens_check), before any variant suffix
                if vname:  # the variant is part of the system's name in every table
                    s["system"] = f"{s['system']}@{vname}"
                    s["name"] = "/".join([s["system"]] + s["name"].split("/")[1:])
                results["runs"].append(s)
                if w.get("timeline"):  # --timeline: per rank, for benchmarks/wave_timeline.py
                    tl = out_dir / ("timeline_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", s["name"]) + ".json")
                    tl.write_text(json.dumps({"name": s["name"], "ranks": w["timeline"]}))
                log(f"  {s['name']:<34} tok/s {s['tokens_per_s'] or 0:9.1f}  ITL p50 {s['itl_p50_ms'] or 0:7.2f} "
                    f"p99 {s['itl_p99_ms'] or 0:7.2f} ms  batch attn {s.get('attn_mean_batch', 0):6.1f} "
                    f"expert {s.get('expert_mean_batch', 0):6.1f}  host us attn {s.get('attn_host_us', 0):6.0f} "
                    f"expert {s.get('expert_host_us', 0):6.0f}  unfinished {s['unfinished']}")
            tokens_check(results, res["workloads"])
        except Exception as err:  # noqa: BLE001
            msg = f"{target} ({','.join(family)}): {type(err).__name__}: {err}"[:1500]
            results["errors"].append(msg)
            log(f"  FAILED {msg}")
            traceback.print_exc(limit=2)
        log(f"launch {target} took {time.perf_counter() - t:.0f} s")
        ratios(results)
        dump()
    ratios(results)
    dump()
    print_table(results)
    log(f"wrote {out_dir / 'ep_bench.json'} and {out_dir / 'ep_bench.md'}")
    return 0 if results["runs"] and not results["errors"] else 1


def parse_links(text, ranks: int):
    """'0-1,2-3' -> [(0, 1), (1, 0), (2, 3), (3, 2)] (a link is delayed both ways); None -> None (every link)."""
    if not text:
        return None
    out = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        a, dash, b = part.partition("-")
        try:
            ra, rb = int(a), int(b)
        except ValueError:
            ra = rb = -1
        if not dash or not (0 <= ra < ranks and 0 <= rb < ranks) or ra == rb:
            raise ValueError(f"--delay-links {text!r}: each link is A-B with two different ranks in 0..{ranks - 1}, "
                             f"got {part!r}")
        out += [(ra, rb), (rb, ra)]
    return out


def parse_variants(text) -> list:
    """'wait0:decode_wait_ms=0;wait2:decode_wait_ms=2' -> [(name, {var: value}), ...], the environment of each variant's
    launch: RuntimeOptions fields go into DATAFLOW_OPTIONS (over this process's options), other keys are environment
    variables as given. None -> one unnamed variant with no environment."""
    from runtime import settings
    if not text:
        return [(None, {})]
    out = []
    for part in filter(None, (x.strip() for x in text.split(";"))):
        name, colon, rest = part.partition(":")
        env = {}
        for kv in filter(None, (x.strip() for x in rest.split(","))):
            k, eq, v = kv.partition("=")
            if not eq or not k.strip():
                raise ValueError(f"--variants {text!r}: {kv!r} is not VAR=VALUE")
            env[k.strip()] = v.strip()
        if not colon or not name.strip() or "/" in name or "@" in name:
            raise ValueError(f"--variants {text!r}: each variant is NAME:VAR=VALUE,... (NAME without / or @), got {part!r}")
        fields = {k: env.pop(k) for k in list(env) if k in settings.RuntimeOptions.model_fields}
        if fields:
            values = settings.parse_set([f"{k}={v}" for k, v in fields.items()])
            try:
                options = settings.options_from(values, f"--variants {name.strip()!r}", settings.current())
            except Exception as err:  # a UserError: the field's value is not valid
                raise ValueError(str(err)) from None
            env[settings.ENV_OPTIONS] = options.model_dump_json(exclude_defaults=True)
        out.append((name.strip(), env))
    return out


if __name__ == "__main__":
    sys.exit(main())
