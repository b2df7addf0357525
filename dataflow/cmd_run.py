"""`dataflow run [PLAN_DIR]`: serve a workload on a compiled plan and print what happened.

With no arguments it runs the plan `dataflow compile` wrote last (./dataflow-plan) on a small seeded
workload, so `dataflow compile tiny && dataflow run` works as written. All run logic lives in
`runtime.drivers.cluster.run_workload(plan, requests, options)`; this module only turns
flags into those arguments and results into files and tables.

By default every rank is its own process (runtime/drivers/multiproc.py: `run_workload_multiprocess`, same
contract as `run_workload`; gloo on CPU, NCCL when the plan targets cuda). Started by `torchrun`
(RANK/WORLD_SIZE set) this process is one rank: rank 0 reads the prompts, prints and writes the
outputs, the other ranks print nothing. `--in-process` runs all ranks in this process instead;
`--clock virtual` (a simulation) always does. A failed rank ends the run with exit code 1 and one
line per failed rank, no traceback.

`-o` gets each request's line as it finishes (in finish order, flushed), so a run that fails keeps every
finished request there; the summary of a failed run says how many finished and which did not. `-o` and
`--trace` are checked before the run (exit 2 when they cannot be written). The trace keeps the run's latest
batches only (runtime/observability/trace.py: a ring per rank), written at the end of a successful run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from graph_ir.errors import UserError


OPTIONS_HELP = "a YAML/JSON file of runtime options (`dataflow options` lists them)"
SET_HELP = "FIELD=VALUE: one runtime option, over --options (repeatable; `dataflow options` lists them)"


def _parse_params(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--policy-param {item!r}: expected KEY=VALUE, e.g. delta=0.9")
        try:
            out[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise UserError(f"--policy-param {item!r}: VALUE must be a number") from None
    return out


def _tokenizer_of(spec):
    """models.tokenizer.Tokenizer of the spec's checkpoint directory, or None (random weights, no tokenizer.json)."""
    if spec.weights.source != "checkpoint":
        return None
    from models.tokenizer import load_tokenizer
    return load_tokenizer(spec.weights.path)


def _sampling_defaults(spec, **flags) -> dict:
    """SamplingParams fields: each flag given (not None), else the checkpoint's generation_config.json default
    (models/generation_config.py: do_sample false means greedy), else greedy with no filter."""
    out = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    if spec.weights.source == "checkpoint":
        from models.generation_config import read_generation_config
        gen = read_generation_config(spec.weights.path)
        if gen is not None:
            out.update(gen.sampling)
    out.update({k: v for k, v in flags.items() if v is not None})
    return out


class RunFailed(UserError):
    """A rank died, wedged or failed: the message names it; exit 1 (not a usage mistake)."""
    exit_code = 1


def check_policy(policy: str, params: dict) -> None:
    """--policy NAME[:KEY=VALUE,...] with `params` (--policy-param): a UserError naming what is valid."""
    from runtime.core.scheduler import POLICIES, make_policy, parse_policy
    try:
        if parse_policy(policy)[0] not in POLICIES:
            raise UserError(f"--policy {policy!r}; valid: {', '.join(POLICIES)} (optionally NAME:KEY=VALUE,...)")
        make_policy(policy, **params)
    except ValueError as err:
        raise UserError(f"--policy {policy!r} / --policy-param: {err}") from None


def cap_hint(metrics: dict, plan) -> str:
    """A line when the attention cap split a rank's decodes into several waves per layer, each costing a whole
    batch's host work per layer on host-bound ranks: a small rest left queued cost 20% of throughput on 2 x H200, and
    two waves of 128 ran 0.58-0.63x the tokens/s of one of 256. Empty when it did not happen."""
    total = metrics.get("attn_batches", 0)
    small, capped = metrics.get("attn_small_remainders", 0), metrics.get("attn_capped_decode", 0)
    cap = next((q.batch_cap for rp in plan.ranks for q in rp.queues if q.kind == "attn"), None)
    fix = ("Compile with a larger --attn-cap (at least the decodes a rank serves at once) or with "
           "--home-policy round_robin.")
    if total and small >= max(2, total // 10):
        return (f"{small} of {total} attention batches hit the cap ({cap} tokens) and left under a quarter of a "
                f"batch queued: a rank served a few more tokens at once than one batch holds, so a small second "
                f"wave ran through every layer. {fix}")
    if total and capped >= max(2, total // 4):
        return (f"{capped} of {total} attention batches were decode batches cut at the cap ({cap} tokens) with more "
                f"decodes queued: a rank ran its decodes as several waves through every layer, and each wave costs "
                f"a batch's host work per layer (on 2 x H200 one wave of 512 ran 1.8x the tokens/s of one of 256). "
                f"{fix}")
    return ""


def _pages_for(requests: list, plan) -> int:
    """KV pages per rank that hold every request at once (prompt + new tokens), with a margin: any rank may be
    the home of all of them. At most the plan's."""
    bs = plan.kv.block_size
    need = sum(-(-(len(r.prompt) + r.max_new_tokens) // bs) for r in requests)
    return min(min(plan.kv.num_blocks), max(need + need // 4 + 8, 64))


def _check_writable(option: str, path: Path) -> None:
    """UserError (exit 2) unless `path` can be written: its directory exists, it is not a directory, and it opens
    for writing. Checked before the run, so a typo does not cost a whole run."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UserError(f"{option} {path}: is a directory")
    if not parent.is_dir():
        raise UserError(f"{option} {path}: {parent} is not an existing directory")
    existed = path.exists()
    try:  # the real test (permissions, a read-only or special file system): open it as the run will
        with open(path, "a"):
            pass
    except OSError as err:
        raise UserError(f"{option} {path}: not writable ({err.strerror or err})") from None
    if not existed:
        path.unlink(missing_ok=True)  # created by the run itself; nothing stays behind if it never gets that far


UNFINISHED_LISTED = 20  # ids of unfinished requests a failed run's summary names (then "and N more")


def _unfinished_summary(finished: list, requests: list, output: Optional[Path]) -> str:
    """What a failed run did: how many requests finished (and where their lines are), which did not."""
    done = {id(r) for r in finished}
    left = [r.name for r in requests if id(r) not in done]
    where = f"; their lines are in {output}" if output is not None and finished else ""
    text = f"{len(finished)} of {len(requests)} requests finished before the failure{where}"
    if left:
        more = f" and {len(left) - UNFINISHED_LISTED} more" if len(left) > UNFINISHED_LISTED else ""
        text += f"\ndid not finish: {', '.join(left[:UNFINISHED_LISTED])}{more}"
    return text


class _BarProgress:
    """The run's progress callback: (finished, total, tokens) moves the bar; `phase(text)` (rank 0's start-up
    phase, runtime/drivers/startup.py StartupTimes.NEXT) labels it: starting the device, building weights, ..., serving."""

    def __init__(self, bar, task) -> None:
        self.bar, self.task = bar, task

    def __call__(self, done: int, total: int, tokens: int) -> None:
        self.bar.update(self.task, completed=done, tokens=tokens)

    def phase(self, text: str) -> None:
        self.bar.update(self.task, description=text)


def _startup_line(startup: dict) -> str:
    """"28.4 s: capture 15.6, imports 5.2, weights 2.4" (the slowest rank's phases, largest first)."""
    parts = sorted(((k, v) for k, v in startup.items() if k not in ("total", "other") and v >= 0.05),
                   key=lambda kv: -kv[1])
    return f"{startup.get('total', 0.0):.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in parts[:4])


def _summary_table(metrics: dict, plan, policy: str):
    from rich.table import Table

    from runtime import settings
    m = metrics
    t = Table(title=f"{plan.spec.name} on {m['ranks']} rank(s), policy {policy}", show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    ms = lambda key: f"{m[key] * 1e3:.2f}"  # noqa: E731
    procs = m.get("processes")  # set by the multi-process runner only
    changed = settings.changed()  # the options this run was given (runtime/settings.py): what a report measured
    # a device-routed expert batch counts every slot of its tokens, this rank's experts or not
    units = {"attn": "tokens", "expert": "slots" if m.get("dispatch") == "device-routed" else "routed rows",
             "sample": "tokens"}
    # (label, value): a row when the value is not empty (None, "" or 0: not this run's)
    rows = [("requests finished", f"{m['finished']} / {m['requests']}"),
            ("processes", f"{procs} (one per rank)" if procs else "1 (all ranks in-process)"),
            ("options", ", ".join(f"{k}={v}" for k, v in changed.items())),
            ("dispatch", m.get("dispatch")),  # the plan's or the option's: device-routed on a GPU, host on the CPU
            ("tokens generated", str(m["tokens"])),
            ("elapsed", f"{m['elapsed_s']:.3f} s"),
            ("tokens/s", f"{m['tokens_per_s']:.1f}"),
            *((f"mean {k} batch", f"{m[f'{k}_mean_batch']:.1f} {unit} ({m[f'{k}_batches']} batches)")
              for k, unit in units.items()),
            ("max queueing delay", f"{ms('max_queue_delay_s')} ms"),
            ("time to first token p50 / p99", f"{ms('p50_ttft_s')} / {ms('p99_ttft_s')} ms"),
            ("time per output token p50 / p99", f"{ms('p50_tpot_s')} / {ms('p99_tpot_s')} ms"),
            ("inter-token latency p50 / p99 / max", f"{ms('p50_itl_s')} / {ms('p99_itl_s')} / {ms('max_itl_s')} ms"),
            ("prompt batches yielded to decode", m.get("prompt_yields") and str(m["prompt_yields"])),  # decode_wait_ms
            ("messages between ranks", str(m["messages"])),
            # the multi-process runner's: each rank's start-up by phase (runtime/drivers/startup.py), what accepted
            # connections during the run, frames not signed with the run's secret (runtime/transport/wire.py)
            ("rank start-up (slowest rank)", m.get("startup_s") and _startup_line(m["startup_s"])),
            ("listening (loopback unless MASTER_ADDR is not)",
             ", ".join(sorted({a.replace("tcp://", "") for a in m.get("listening") or ()}))),
            ("frames dropped (not this run's)", m.get("dropped_frames") and str(m["dropped_frames"]))]
    for label, value in rows:
        if value:
            t.add_row(label, value)
    return t


def register(app: typer.Typer) -> None:
    from dataflow.cli import DEFAULT_PLAN_DIR

    @app.command()
    def run(
        plan_dir: Path = typer.Argument(Path(DEFAULT_PLAN_DIR), help="plan directory written by `dataflow compile`"),
        prompts: Optional[Path] = typer.Option(None, "--prompts",
                                               help='JSONL: {"id", "prompt_token_ids" | "prompt" (text) | "messages" '
                                                    '(chat), "max_new_tokens"?, "temperature"?, "top_p"?, "top_k"?, '
                                                    '"seed"?, "stop_token_ids"?, "stop"?} per line; text needs a '
                                                    'checkpoint with tokenizer.json'),
        max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="for requests that do not set their own"),
        num_requests: int = typer.Option(8, "--num-requests", help="size of the default workload (no --prompts)"),
        ignore_eos: bool = typer.Option(False, "--ignore-eos", help="always generate max_new_tokens"),
        policy: str = typer.Option("defrag", "--policy", help="scheduler: flfs, mtfs, defrag or aging"),
        policy_param: list[str] = typer.Option([], "--policy-param",
                                               help="policy parameter KEY=VALUE, repeatable (e.g. delta=0.9, "
                                                    "lookahead=4, history=4, bound=0.05)"),
        temperature: Optional[float] = typer.Option(None, "--temperature",
                                                    help="0 = greedy (default: the checkpoint's "
                                                         "generation_config.json, else greedy)"),
        top_p: Optional[float] = typer.Option(None, "--top-p", help="default: generation_config.json's, else 1"),
        top_k: Optional[int] = typer.Option(None, "--top-k",
                                            help="0 = off (default: generation_config.json's, else 0)"),
        stop_token_id: list[int] = typer.Option([], "--stop-token-id",
                                                help="a token id that ends a request besides the model's EOS; "
                                                     "repeatable"),
        stop: list[str] = typer.Option([], "--stop", help="a string that ends a request's text (needs a tokenizer); "
                                                          "repeatable"),
        seed: int = typer.Option(0, "--seed", help="sampling seed (request i uses seed + i) and workload seed"),
        output: Optional[Path] = typer.Option(None, "--output", "-o", help="write one JSON line per request"),
        trace: Optional[Path] = typer.Option(None, "--trace", help="write a Chrome/Perfetto trace JSON"),
        in_process: bool = typer.Option(False, "--in-process", help="run all ranks in this process (default: one "
                                                                   "process per rank)"),
        procs_timeout: Optional[float] = typer.Option(None, "--procs-timeout",
                                                      help="seconds before a multi-process run is terminated "
                                                           "(default: no limit)"),
        peer_timeout: float = typer.Option(10.0, "--peer-timeout",
                                           help="seconds of silence after which a rank counts as dead or wedged"),
        stall_timeout: float = typer.Option(60.0, "--stall-timeout",
                                            help="floor, in seconds, of how long a rank's loop (or, with requests "
                                                 "outstanding, every rank's batches) may stand still before the run "
                                                 "is called stalled; the bound grows to 10x the longest pause seen"),
        clock: str = typer.Option("wall", "--clock",
                                  help="wall, or virtual (batches timed by the cost model: a simulation)"),
        kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", help="override KV pages per rank"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
        options_file: Optional[Path] = typer.Option(None, "--options", help=OPTIONS_HELP),
        set_option: list[str] = typer.Option([], "--set", help=SET_HELP),
    ) -> None:
        """Run a workload on PLAN_DIR and print a summary (requests, tokens, tokens/s, batch sizes)."""
        from pydantic import ValidationError
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from lowering.plan import load_plan
        from models.sampling import SamplingParams
        from runtime.drivers.cluster import RunOptions, run_workload
        from runtime.drivers.workload import default_workload, load_prompts

        console = Console(stderr=True)
        from runtime import settings
        settings.from_flags(options_file and str(options_file), set_option)
        plan = load_plan(plan_dir)
        spec = plan.spec
        params = _parse_params(policy_param)
        check_policy(policy, params)
        if clock not in ("wall", "virtual"):
            raise UserError(f"--clock {clock!r}; valid: wall, virtual")
        if max_new_tokens < 1:
            raise UserError(f"--max-new-tokens {max_new_tokens}; valid: 1..{spec.max_position} "
                            f"({spec.name}'s max_position, which prompt + new tokens must fit)")
        # The default workload is a seeded demo (each request a Python object with its prompt); 100,000 requests of 16
        # tokens already take hours on a CPU plan, and a count like 10**8 only stalls before the first token.
        # A bigger workload is a --prompts file.
        max_requests = 100_000
        if prompts is None and not 1 <= num_requests <= max_requests:
            raise UserError(f"--num-requests {num_requests}; valid: 1..{max_requests} "
                            f"(larger workloads: --prompts FILE)")
        if prompts is None and max_new_tokens > spec.max_position - 7:
            # Like vLLM, which refuses a request whose prompt + max_tokens exceeds max_model_len: the default workload
            # shortens its prompts (8 to 48 tokens, and a few of 1-8) to fit, but not below 8 tokens.
            raise UserError(f"--max-new-tokens {max_new_tokens}: prompt + new tokens must fit {spec.name}'s "
                            f"max_position {spec.max_position}, and the default workload needs room for prompts of 8 "
                            f"tokens; valid: 1..{spec.max_position - 7} (or --prompts FILE with shorter "
                            f"prompts)" if spec.max_position > 7 else
                            f"--max-new-tokens {max_new_tokens}: {spec.name}'s max_position {spec.max_position} is "
                            f"too short for the default workload's prompts (8 tokens and more); pass --prompts FILE")
        if kv_blocks is not None and kv_blocks < 1:
            raise UserError(f"--kv-blocks {kv_blocks}; valid: a positive number of KV pages per rank "
                            f"(the plan has {min(plan.kv.num_blocks)})")
        try:
            sampling = SamplingParams(**_sampling_defaults(spec, temperature=temperature, top_p=top_p, top_k=top_k),
                                      seed=seed)
        except ValidationError as err:
            e = err.errors()[0]
            opt = "--" + str(e["loc"][0]).replace("_", "-")
            raise UserError(f"sampling option {e['loc'][0]} ({opt} {e.get('input')!r}): {e['msg']}") from None
        if spec.weights.source == "checkpoint":
            # Header-only, no tensor read: a checkpoint changed or truncated since compile fails here with one line,
            # not with a traceback in every rank process.
            from models.checkpoint import check_checkpoint
            check_checkpoint(spec.weights.path, require_weights=True, spec=spec)

        for opt, value in (("--peer-timeout", peer_timeout), ("--procs-timeout", procs_timeout),
                           ("--stall-timeout", stall_timeout)):
            if value is not None and not 0 < value < float("inf"):
                raise UserError(f"{opt} {value}; valid: a positive number of seconds")
        # The virtual clock is a simulation of the whole cluster: it needs every rank in one process.
        multi = not (in_process or clock == "virtual")
        from runtime.drivers.launch import from_torchrun_env
        torchrun = from_torchrun_env() if multi else None
        # Under torchrun only rank 0 reads the prompts, prints and writes the outputs; the others serve what it sends.
        reports = torchrun is None or torchrun.rank == 0
        import os
        # Without torchrun every rank is a process started on this machine, each with its own torch runtime
        # (~0.3-0.5 GB resident) and its own serving loop: beyond one per core (at least 8, so small boxes still run
        # the 4-rank benchmarks) they only compete for memory and cores; 1,000 of them were OOM-killed.
        max_local = max(8, os.cpu_count() or 1)
        if multi and torchrun is None and plan.cluster.ranks > max_local:
            raise UserError(f"{plan_dir}: the plan has {plan.cluster.ranks} ranks, and `dataflow run` starts one "
                            f"process per rank on this machine; valid: at most {max_local} local rank processes "
                            f"(max(8, {os.cpu_count()} CPU cores)); start the ranks across hosts with torchrun, run "
                            f"them all in this process with --in-process, or compile for fewer --ranks")
        # Text in, text out: the tokenizer of the checkpoint the plan was compiled from (spec.weights.path); a spec
        # with random weights has none and serves ids only.
        tokenizer = _tokenizer_of(spec) if reports else None
        bad = [t for t in stop_token_id if not 0 <= t < spec.vocab_size]
        if bad:
            raise UserError(f"--stop-token-id {bad[0]}: outside the vocabulary 0..{spec.vocab_size - 1} of {spec.name}")
        if stop and tokenizer is None and reports:
            from runtime.drivers.workload import no_tokenizer_reason
            raise UserError(f"--stop {stop[0]!r}: stop strings need the text of the output, and "
                            f"{no_tokenizer_reason(spec)}; valid: --stop-token-id")
        if any(not s for s in stop):
            raise UserError("--stop '': valid: a non-empty string")
        if not reports:
            requests = []
        elif prompts is not None:
            # load_prompts gives request i the seed seed + i unless its line sets one
            requests = load_prompts(prompts, spec, max_new_tokens, sampling, ignore_eos, tokenizer,
                                    tuple(stop_token_id), tuple(stop))
        else:
            # (request i samples with the seed seed + i)
            requests = default_workload(spec, num_requests, max_new_tokens, seed, sampling, ignore_eos,
                                        stop_token_ids=tuple(stop_token_id), tokenizer=tokenizer)

        note = None
        if plan.cluster.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                note = "plan targets cuda but no GPU is visible; running on CPU (the CUDA executor's CPU twin)"
                if kv_blocks is None and requests:
                    # The twin preallocates its KV pool in host memory, zeroed at every workload start: a pool
                    # sized for the plan's GPUs would take the host's memory and most of the run's time
                    # (runtime/executors/kv_fit.py clamps it to the host's memory only as a last resort).
                    kv_blocks = _pages_for(requests, plan)
                    note += f", with a KV pool of {kv_blocks} pages per rank for these requests (--kv-blocks sets it)"
        options = RunOptions(policy=policy, policy_params=params, clock=clock, trace=trace is not None,
                             kv_blocks=kv_blocks, stall_timeout_s=stall_timeout)
        if reports:  # the process that writes them: fail now, not after the whole run
            for opt, path in (("--output", output), ("--trace", trace)):
                if path is not None:
                    _check_writable(opt, path)
        if output is not None:
            # Each request's line is written as it finishes (by rank 0's coordinator, or the in-process driver): a
            # failed run keeps every finished one. Out of process, rank 0 then keeps no outputs (flat memory).
            options.output_path = str(output)
            options.keep_outputs = not multi
        if note:
            console.print(f"[yellow]note:[/] {note}")

        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[tokens]} tokens"), TimeElapsedColumn(), console=console,
                      disable=quiet or not reports, transient=True) as bar:
            task = bar.add_task("starting the ranks" if multi else "serving", total=len(requests),
                                tokens=0)
            options.progress = _BarProgress(bar, task)
            try:
                if multi:
                    from runtime.drivers.multiproc import run_workload_multiprocess
                    result = run_workload_multiprocess(plan, requests, options, timeout=procs_timeout,
                                                       peer_timeout_s=peer_timeout)
                else:
                    result = run_workload(plan, requests, options)
            except ValueError as err:  # e.g. a request larger than any rank's KV pool
                raise UserError(str(err)) from None
            except Exception as err:
                from runtime.drivers.multiproc import RunFailed as RanksFailed
                if hasattr(err, "finished"):
                    bar.stop()
                    console.print(_unfinished_summary(err.finished, requests, output), markup=False, highlight=False,
                                  soft_wrap=True)
                if isinstance(err, RanksFailed):
                    raise RunFailed(f"run failed: {err}") from None
                raise

        if result is None:  # a torchrun rank other than 0: rank 0 reports
            return

        if trace is not None and result.trace is not None:
            result.trace.write(trace, result.world_size)
        Console().print(_summary_table(result.metrics, plan, policy))
        hint = cap_hint(result.metrics, plan)
        if hint:
            console.print(f"[yellow]hint:[/] {hint}")
        if output is not None:
            console.print(f"outputs: {output} (one line per request, in the order they finished)")
        if trace is not None:
            console.print(f"trace: {trace} (open in https://ui.perfetto.dev)")
