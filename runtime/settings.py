"""Every runtime knob in one place: `RuntimeOptions`, its defaults, valid values and meaning.

A run's options come from, lowest to highest priority: the defaults below, a file (`dataflow run --options
FILE`, YAML or JSON), `--set FIELD=VALUE` flags, and for processes started by someone else (torchrun, a
test) the one environment override, `DATAFLOW_OPTIONS` (a JSON object of the same fields). `configure()`
installs a run's options in this process and exports them in `DATAFLOW_OPTIONS`, so the rank processes the
launcher starts serve with the same ones; `current()` is what the runtime reads. Each run's summary lists
the options that differ from the defaults (`changed()`).

This module is also the only place the runtime reads its environment: the launcher's hand-over to its rank
processes and torchrun's variables (`LaunchEnvironment`), and the run's frame-signing secret
(`run_secret_hex`). Choices a measurement has settled are not options: the winning path is the only one
(benchmarks/NOTES.md records each measurement).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from graph_ir.errors import UserError

ENV_OPTIONS = "DATAFLOW_OPTIONS"


class RuntimeOptions(BaseModel):
    """The knobs that survive. Each field's default and description are what `dataflow options` prints."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kernels: Literal["auto", "torch", "triton"] = Field(
        "auto", description="which version of each kernel runs: auto = Triton when the tensors are on CUDA, the "
        "torch reference elsewhere; torch = always the reference; triton = always Triton (on CPU tensors only "
        "under TRITON_INTERPRET=1, Triton's interpreter)")
    dispatch: Literal["auto", "host", "device"] = Field(
        "auto", description="how an attention batch reaches its experts: auto = the plan's (`dataflow compile "
        "--dispatch`); host = the routing comes to the host and each owner gets its rows; device = the whole "
        "batch with its expert ids goes to every owner, which selects on the device (needs the CUDA executor)")
    decode_wait_ms: float = Field(
        2.0, ge=0, description="a batch of prompt rows alone gives way to a stage whose decode rows have waited "
        "this long (0: prompts never give way)")
    device_wait_s: float = Field(
        300.0, gt=0, description="bound of every host wait for a device copy (routing, tokens, a staging slot); "
        "past it the rank fails naming the copy")
    nccl_library: Optional[str] = Field(
        None, description="path of the libnccl to load (default: torch's own copy)")
    rank_threads: Optional[int] = Field(
        None, ge=1, description="torch intra-op threads per rank process (default: 1 per GPU rank; the host's "
        "cores / its ranks on CPU)")
    verbose: bool = Field(False, description="rank processes log their steps")
    profile_steps: bool = Field(
        False, description="time each executor call, dispatch, send and receive post (the run report's step "
        "timers)")
    profile_ranks: Optional[str] = Field(
        None, pattern=r"^(all|\d+(,\d+)*)$", description="ranks whose serving loop runs under the profiler: "
        "a comma list or `all` (phase timers, cProfile, the torch window below)")
    profile_out: str = Field(
        "dataflow-rank{rank}.prof", description="where a profiled rank writes its cProfile stats ({rank} is "
        "replaced)")
    profile_cprofile: bool = Field(True, description="profiled ranks run under cProfile (off: phase timers only)")
    profile_torch: Optional[str] = Field(
        None, pattern=r"^\d+:\d+$", description="START:COUNT: a torch.profiler trace of those batches of each "
        "profiled rank")

    @field_validator("profile_ranks", mode="before")
    @classmethod
    def _rank_number(cls, value: Any) -> Any:
        # `--set profile_ranks=0` and an options file's `profile_ranks: 0` read the rank as a number
        return str(value) if type(value) is int else value


def _refuse(err: ValidationError, source: str) -> UserError:
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "(the object)"
    valid = RuntimeOptions.model_fields.get(field)
    hint = f"; {field}: {valid.description}" if valid is not None and valid.description else ""
    if first["type"] == "extra_forbidden":
        hint = f"; valid fields: {', '.join(RuntimeOptions.model_fields)}"
    return UserError(f"{source}: {field}={first.get('input')!r}: {first['msg']}{hint}")


def options_from(values: dict[str, Any], source: str, base: Optional[RuntimeOptions] = None) -> RuntimeOptions:
    """`base` (default: the defaults) updated with `values`, validated; a mistake is a UserError naming
    `source`, the field, the value and what is valid."""
    merged = {**(base.model_dump(exclude_unset=True) if base is not None else {}), **values}
    try:
        return RuntimeOptions(**merged)
    except ValidationError as err:
        raise _refuse(err, source) from None


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set FIELD=VALUE` flags as a dict; VALUE is read as JSON when it parses (numbers, true/false, null),
    else kept as a string."""
    out: dict[str, Any] = {}
    for item in items:
        field, eq, raw = item.partition("=")
        if not eq or not field.strip():
            raise UserError(f"--set {item!r}: expected FIELD=VALUE; fields: {', '.join(RuntimeOptions.model_fields)}")
        try:
            out[field.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[field.strip()] = raw
    return out


def read_options_file(path: str) -> dict[str, Any]:
    """An options file (YAML or JSON, a mapping of RuntimeOptions fields)."""
    from graph_ir.files import load_yaml  # (YAML is a superset of JSON; the reader refuses duplicate keys)

    data = load_yaml(path, "an options file")
    if not isinstance(data, dict):
        raise UserError(f"{path}: an options file is a mapping of fields ({', '.join(RuntimeOptions.model_fields)})")
    return data


def from_flags(options_file: Optional[str], sets: list[str]) -> RuntimeOptions:
    """A command's options: the environment's (DATAFLOW_OPTIONS), then `--options FILE`, then `--set` flags;
    installed with `configure`."""
    opts = current()
    if options_file:
        opts = options_from(read_options_file(options_file), str(options_file), opts)
    if sets:
        opts = options_from(parse_set(sets), "--set", opts)
    return configure(opts)


_current: Optional[RuntimeOptions] = None
_current_env: Optional[str] = None


def _from_environment() -> RuntimeOptions:
    from graph_ir.files import parse_json  # (a key given twice or NaN refused, as in an options file)

    raw = os.environ.get(ENV_OPTIONS, "").strip()
    if not raw:
        return RuntimeOptions()
    values = parse_json(raw, ENV_OPTIONS, "a JSON object")
    if not isinstance(values, dict):
        raise UserError(f"{ENV_OPTIONS}: expected a JSON object of fields, got {type(values).__name__}")
    return options_from(values, ENV_OPTIONS)


def current() -> RuntimeOptions:
    """This process's options: the last `configure()`d, else `DATAFLOW_OPTIONS` (re-read when it changes)."""
    global _current, _current_env
    raw = os.environ.get(ENV_OPTIONS)
    if _current is None or raw != _current_env:
        _current, _current_env = _from_environment(), raw
        _apply(_current)
    return _current


def configure(options: RuntimeOptions) -> RuntimeOptions:
    """Install `options` in this process and in the environment the rank processes it starts inherit."""
    global _current, _current_env
    raw = options.model_dump_json(exclude_defaults=True)
    if raw == "{}":
        os.environ.pop(ENV_OPTIONS, None)
        raw_env = None
    else:
        os.environ[ENV_OPTIONS] = raw_env = raw
    _current, _current_env = options, raw_env
    _apply(options)
    return options


def changed(options: Optional[RuntimeOptions] = None) -> dict[str, Any]:
    """The options that differ from their defaults (a run summary lists them)."""
    return (options or current()).model_dump(exclude_defaults=True)


def _apply(options: RuntimeOptions) -> None:
    from dataflow_kernels import dispatch

    dispatch.use_backend(options.kernels)


@dataclass(frozen=True)
class LaunchEnvironment:
    """What the environment says about this process's place in a run: torchrun's variables, or the hand-over
    `dataflow run`'s launcher (runtime/drivers/launch.py) gives each rank process it starts."""

    rank: Optional[int]
    world_size: Optional[int]
    local_rank: Optional[int]
    local_world_size: Optional[int]
    master_addr: str
    master_port: int
    launch_dir: Optional[str]  # set by our launcher only (so: not torchrun)
    launch_parent: Optional[int]
    spawned_at: Optional[float]

    @staticmethod
    def read(environ: Optional[dict] = None) -> "LaunchEnvironment":
        env = os.environ if environ is None else environ

        def num(name: str, kind=int):
            v = env.get(name)
            if v in (None, ""):
                return None
            try:
                return kind(v)
            except ValueError:
                raise UserError(f"environment variable {name}={v!r}: expected a number") from None

        return LaunchEnvironment(
            rank=num("RANK"), world_size=num("WORLD_SIZE"), local_rank=num("LOCAL_RANK"),
            local_world_size=num("LOCAL_WORLD_SIZE"), master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
            master_port=num("MASTER_PORT") or 29500, launch_dir=env.get("DATAFLOW_LAUNCH_DIR") or None,
            launch_parent=num("DATAFLOW_LAUNCH_PARENT"), spawned_at=num("DATAFLOW_SPAWNED_AT", float))


def launch_environment() -> LaunchEnvironment:
    return LaunchEnvironment.read()


def run_secret_hex() -> str:
    """DATAFLOW_RUN_SECRET as set (hex; "" when unset). A secret, not an option: it never appears in a
    summary, a file or DATAFLOW_OPTIONS. runtime/transport/rendezvous.run_secret validates it."""
    return os.environ.get("DATAFLOW_RUN_SECRET", "").strip()


def configure_nccl() -> None:
    """NCCL's own environment, before its first communicator: NVLink SHARP (multicast) buffers are not needed for
    point-to-point and fail on some lent machines (an explicit NCCL_NVLS_ENABLE is kept)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def environment_copy() -> dict[str, str]:
    """This process's environment, for a child process (the launcher's ranks, the serving front's)."""
    return dict(os.environ)
