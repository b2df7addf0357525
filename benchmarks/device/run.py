"""The device runner: runs named entries of benchmarks/device/matrix.yaml, each one recorded kind of run.

    bash benchmarks/device/run.sh OUT ENTRY [ENTRY...] [--var NAME=VALUE ...] [--set FIELD=VALUE ...]
    python3 benchmarks/device/run.py --list                     # the entries, their machine and minutes
    python3 benchmarks/device/run.py OUT ENTRY... --dry-run     # the commands, nothing run

run.sh sources start.sh first (the carried wheels, the NCCL settings, OUT/env.txt). For each entry the runner
exports the entry's `options` (RuntimeOptions fields, with the --set ones over them) as DATAFLOW_OPTIONS, the
runtime's one environment override, and its `env`; fills each step's {placeholders} from the entry's `vars` (the
--var ones over them), {out} (OUT/ENTRY, made) and {tmp} (a scratch folder: what the tool should not bring back);
runs the step in a shell under its `timeout`, its output to {out}/LOG; appends "ENTRY LOG exit N" to OUT/env.txt;
prints the log's lines that match `show` (a regex; all of them when it is `all`, its last 3 lines without one);
and copies the `keep` files ({tmp}/PATH: NAME) to {out}. A step that fails does not stop the next: each answers a
question of its own, and the device time is spent either way.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MATRIX = Path(__file__).with_name("matrix.yaml")
STEP_KEYS = {"run", "timeout", "log", "show", "keep"}
ENTRY_KEYS = {"machine", "minutes", "what", "carry", "vars", "options", "env", "steps"}


def load_matrix(path: Path = MATRIX) -> dict:
    import yaml
    doc = yaml.safe_load(path.read_text())
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{path}: expected a mapping `entries:` of named runs")
    for name, e in entries.items():
        bad = set(e) - ENTRY_KEYS
        if bad or not e.get("steps") or not e.get("machine"):
            raise ValueError(f"{path}: entry {name!r}: needs machine and steps; unknown keys {sorted(bad)}")
        for i, step in enumerate(e["steps"]):
            if not isinstance(step, dict) or "run" not in step or set(step) - STEP_KEYS:
                raise ValueError(f"{path}: entry {name!r} step {i + 1}: a mapping with `run` and only {sorted(STEP_KEYS)}")
    return entries


def fill(text: str, values: dict) -> str:
    """{name} replaced where name is a known placeholder; other braces (a Python format the step passes on, such
    as profile_out's {rank}) are left as they are."""
    def sub(m: re.Match) -> str:
        return str(values[m.group(1)]) if m.group(1) in values else m.group(0)
    return re.sub(r"\{([a-z_][a-z0-9_]*)\}", sub, text)


def pairs(items: list[str], flag: str) -> dict:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"{flag} {item!r}: expected NAME=VALUE")
        out[key] = value
    return out


def plan_entry(name: str, entry: dict, out_root: Path, tmp: Path, var_over: dict, set_over: dict) -> list[dict]:
    """The steps of `entry` with every placeholder filled: [{run, timeout, log, show, keep, env}]."""
    values = {**{k: str(v).strip() for k, v in (entry.get("vars") or {}).items()}, **var_over}
    values.update(out=str(out_root / name), tmp=str(tmp / name))
    env = {k: fill(str(v), values) for k, v in (entry.get("env") or {}).items()}
    options = {k: json.loads(fill(json.dumps(v), values)) for k, v in (entry.get("options") or {}).items()}
    for field, raw in set_over.items():
        try:
            options[field] = json.loads(raw)
        except json.JSONDecodeError:
            options[field] = raw
    if options:
        env["DATAFLOW_OPTIONS"] = json.dumps(options, separators=(",", ":"))
    steps = []
    for i, step in enumerate(entry["steps"]):
        steps.append({"run": fill(step["run"], values).strip(), "timeout": int(step.get("timeout", 600)),
                      "log": step.get("log", f"step{i + 1}.log"), "show": step.get("show"),
                      "keep": {fill(k, values): v for k, v in (step.get("keep") or {}).items()}, "env": env})
    return steps


def run_step(name: str, step: dict, out_root: Path) -> int:
    out = out_root / name
    log = out / step["log"]
    env = {**os.environ, **step["env"]}
    with log.open("w") as f:
        try:
            rc = subprocess.run(["bash", "-c", step["run"]], stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=step["timeout"]).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with (out_root / "env.txt").open("a") as f:
        f.write(f"{name} {step['log']} exit {rc}\n")
    lines = log.read_text(errors="replace").splitlines()
    show = step["show"]
    picked = lines if show == "all" else [x for x in lines if re.search(show, x)] if show else lines[-3:]
    print(f"--- {name} {step['log']} exit {rc}")
    print("\n".join(x[:300] for x in picked), flush=True)
    for src, dest in step["keep"].items():
        if Path(src).exists():
            shutil.copy(src, out / dest)
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="the output folder ($OUT of the device tool)")
    p.add_argument("entries", nargs="*", help="matrix entries to run, in order")
    p.add_argument("--var", action="append", default=[], help="NAME=VALUE: a placeholder's value, over the entry's")
    p.add_argument("--set", action="append", default=[], help="FIELD=VALUE: a RuntimeOptions field for every step")
    p.add_argument("--matrix", type=Path, default=MATRIX)
    p.add_argument("--list", action="store_true", help="list the entries and exit")
    p.add_argument("--dry-run", action="store_true", help="print each step's command and environment, run nothing")
    args = p.parse_args(argv)
    entries = load_matrix(args.matrix)
    if args.list:
        for name, e in entries.items():
            print(f"{name:<18} {e['machine']:<15} ~{e.get('minutes', '?')} min  {' '.join(str(e.get('what', '')).split())}")
        return 0
    if not args.out or not args.entries:
        p.error("OUT and at least one ENTRY are needed (--list shows the entries)")
    unknown = [n for n in args.entries if n not in entries]
    if unknown:
        p.error(f"unknown entries {unknown}; known: {', '.join(entries)}")
    var_over, set_over = pairs(args.var, "--var"), pairs(args.set, "--set")
    out_root = Path(args.out).resolve()
    tmp = Path("/tmp/device_run.DRY") if args.dry_run else Path(tempfile.mkdtemp(prefix="device_run."))
    failed = 0
    for name in args.entries:
        steps = plan_entry(name, entries[name], out_root, tmp, var_over, set_over)
        if args.dry_run:
            for s in steps:
                print(f"[{name}] {' '.join(f'{k}={v!r}' for k, v in s['env'].items())} timeout {s['timeout']} "
                      f"{s['run']} > {s['log']}")
            continue
        (out_root / name).mkdir(parents=True, exist_ok=True)
        (tmp / name).mkdir(parents=True, exist_ok=True)
        failed += sum(run_step(name, s, out_root) != 0 for s in steps)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
