"""`dataflow compile MODEL`: lower a model onto a cluster shape and write PLAN_DIR/plan.json.

MODEL is a YAML spec path, a shipped model name (`tiny`, `gpt-oss-120b`, ... from models/specs),
or a Hugging Face checkpoint directory (a folder with config.json).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec, cut_layers, load_spec
from lowering.plan import DEFAULT_ATTN_CAP
from lowering.summary import compress_ids, placement_text

GIB = 1024 ** 3


def shipped_specs_dir() -> Path:
    import models
    return Path(models.__file__).resolve().parent / "specs"


def shipped_models() -> list[str]:
    return sorted(p.stem for p in shipped_specs_dir().glob("*.yaml"))


def resolve_model(model: str) -> tuple[ModelSpec, str]:
    """MODEL argument -> (spec, description of where it came from). Paths win over shipped names."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path}: a directory without config.json; MODEL must be a model YAML, a shipped "
                            f"model name ({', '.join(shipped_models())}) or a Hugging Face checkpoint directory")
        from models.checkpoint import import_spec  # (lazy: it pulls in safetensors and torch)
        return import_spec(path), f"checkpoint {path}"
    if path.exists() and not path.is_file():
        raise UserError(f"{path}: not a regular file; MODEL must be a model YAML, a shipped model name or a Hugging "
                        f"Face checkpoint directory")
    if path.is_file():
        return load_spec(path), str(path)
    shipped = shipped_specs_dir() / f"{model}.yaml"
    if "/" not in model and shipped.is_file():
        return load_spec(shipped), f"shipped model '{model}'"
    raise UserError(f"MODEL {model!r}: no such file, directory or shipped model; valid shipped models: "
                    f"{', '.join(shipped_models())}")


def register(app: typer.Typer) -> None:
    from dataflow.cli import DEFAULT_PLAN_DIR

    @app.command()
    def compile(
        model: str = typer.Argument(..., help="model YAML, shipped model name (e.g. tiny), or HF checkpoint dir"),
        out: Path = typer.Option(Path(DEFAULT_PLAN_DIR), "-o", "--out", help="plan directory to write"),
        ranks: int = typer.Option(2, "--ranks", "-n", help="number of ranks (one device each): 1..64 on cpu (a "
                                                          "process each), 1..1024 on cuda"),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
        placement: str = typer.Option("contiguous", "--placement", help="contiguous, round_robin or profile"),
        load_profile: Optional[Path] = typer.Option(None, "--load-profile",
                                                    help="per-expert load (JSON/YAML) for --placement profile"),
        device_memory: Optional[float] = typer.Option(None, "--device-memory",
                                                      help="GiB per device (default cpu 16, cuda 132: an H200's 139.8 less context/NCCL/workspace room)"),
        block_size: int = typer.Option(16, "--block-size", help="KV cache page size in tokens"),
        attn_cap: int = typer.Option(DEFAULT_ATTN_CAP, "--attn-cap",
                                     help="max tokens per attention batch (also the prompt chunk): a home's decodes run "
                                          "as one wave per layer while they fit it"),
        expert_cap: Optional[int] = typer.Option(None, "--expert-cap",
                                                 help="max routed rows per expert batch (default: 1024; with the "
                                                      "device-routed dispatch, slots: ranks x attn cap x top-k)"),
        home_policy: str = typer.Option("most_free_kv", "--home-policy", help="most_free_kv or round_robin"),
        dispatch: str = typer.Option("auto", "--dispatch",
                                     help="auto (device on cuda, host on cpu), host (routing read on the host, each "
                                          "holder gets its routed rows) or device (whole batches with their expert "
                                          "ids to every holder, selected on the device)"),
        min_kv_tokens: int = typer.Option(2048, "--min-kv-tokens",
                                          help="refuse plans whose ranks cannot cache this many tokens"),
        max_kv_tokens: Optional[int] = typer.Option(None, "--max-kv-tokens",
                                                    help="cap KV tokens per rank (default: all memory left)"),
        replicas: str = typer.Option("0", "--replicas",
                                     help="extra expert copies per MoE layer, hottest first by --load-profile, or auto "
                                          "(as the load asks, within memory); needs --dispatch host"),
        attention_ranks: Optional[int] = typer.Option(None, "--attention-ranks",
                                                      help="K: ranks 0..K-1 run attention and home requests, the "
                                                           "experts go on the other ranks"),
        dump_after: Optional[str] = typer.Option(None, "--dump-after",
                                                 help="print the graph or plan section after this lowering pass"),
        layers: Optional[int] = typer.Option(None, "--layers",
                                             help="keep only the first N layers (e.g. GPT-OSS-120B cut to 18 to fit 2 GPUs)"),
    ) -> None:
        """Compile MODEL for a cluster of RANKS devices and write PLAN_DIR/plan.json."""
        from lowering.plan import compile_plan, save_plan

        spec, source = resolve_model(model)
        note = None
        if spec.weights.source == "checkpoint":
            # Header-only (no tensor is read): every tensor the model needs is there with its shape, and every file
            # holds the bytes its header promises, so a bad checkpoint fails here, not in every rank of `run`.
            from models.checkpoint import SpecCheckpointMismatch, check_checkpoint
            from_yaml = not source.startswith("checkpoint ")
            try:
                # A YAML naming a checkpoint is also compared with its config.json, field by field.
                note = check_checkpoint(spec.weights.path, require_weights=False, spec=spec,
                                        source=source if from_yaml else None)
            except UserError as err:
                if not from_yaml or isinstance(err, SpecCheckpointMismatch):
                    raise
                raise UserError(f"{source}: field 'weights.path': {err}") from None  # a YAML naming a checkpoint
        if layers is not None:
            if not 1 <= layers <= spec.num_layers:
                raise UserError(f"option 'layers': got {layers}; valid: 1..{spec.num_layers} ({spec.name} has "
                                f"{spec.num_layers} layers)")
            spec = cut_layers(spec, layers)
            source += f", first {spec.num_layers} layers"
        plan = compile_plan(spec, ranks, device, device_memory_gib=device_memory, placement=placement,
                            load_profile=load_profile, home_policy=home_policy, block_size=block_size,
                            attn_cap=attn_cap, expert_cap=expert_cap, min_kv_tokens=min_kv_tokens,
                            max_kv_tokens=max_kv_tokens, dispatch=dispatch, replicas=replicas,
                            attention_ranks=attention_ranks, dump_after=dump_after, source=source)
        path = save_plan(plan, out)
        _print_summary(plan, path)
        if spec.weights.source == "checkpoint":
            from models.hf_config import ignored_keys, read_config
            data, cfg_path = read_config(spec.weights.path)
            keys = ignored_keys(data, str(cfg_path))
            if keys:
                typer.echo(f"config.json keys ignored (no effect on the forward pass): {', '.join(keys)}", err=True)
        if note:
            typer.echo(f"note: {note}", err=True)


def _print_summary(plan, path: Path) -> None:
    from rich.console import Console

    from dataflow.cmd_inspect import new_table
    s, c = plan.spec, plan.cluster
    console = Console()
    console.print(f"[bold]{s.name}[/] ({s.family}): {s.num_layers} layers, {s.experts.num_experts} experts "
                  f"top-{s.experts.top_k}, {s.dtype} -> {c.ranks} x {c.device} ({c.device_memory_gib:g} GiB), "
                  f"{len(plan.stages)} stages, {placement_text(plan)}, {c.dispatch}-routed dispatch")
    table = new_table("rank", "experts/layer", "weights GiB", "KV tokens", "KV blocks", "graphs GiB",
                      right=("rank", "weights GiB", "KV tokens", "KV blocks", "graphs GiB"))
    first = s.moe_layers[0]
    shown = plan.memory if c.ranks <= 16 else plan.memory[:8] + plan.memory[-4:]
    for m in shown:
        table.add_row(str(m.rank), compress_ids(plan.placement.experts_on(first, m.rank)),
                      f"{m.weight_bytes / GIB:.3f}", str(m.kv_capacity_tokens), str(m.kv_blocks),
                      f"{m.graph_bytes / GIB:.3f}")
    console.print(table)
    if c.ranks > 16:
        console.print(f"({c.ranks - len(shown)} ranks not shown; `dataflow inspect {path.parent}` has all)")
    console.print(f"wrote {path} (summary in {path.parent / 'plan.txt'})")
