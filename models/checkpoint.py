"""Hugging Face checkpoint directory (config.json + safetensors) -> (ModelSpec, ModelWeights).

    import_spec(dir)      config.json only -> ModelSpec (weights.source = checkpoint, path = dir); the stop ids are
                          generation_config.json's eos_token_id when it sets one (as in transformers' generate)
    load_checkpoint(dir, experts=None)  -> (ModelSpec, ModelWeights in spec.dtype), every tensor
                          shape-checked; `experts`: only these routed experts per layer (a rank's)

The config translation lives in models/hf_config.py, the tensor mapping in models/hf_weights.py.
Supported architectures: see `SUPPORTED_ARCHITECTURES`. Everything a user can get wrong (no
config.json, unknown architecture, an unsupported setting, a missing or mis-shaped tensor) is a
`UserError` naming the file and the key or tensor.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec
from models.hf_config import ARCHITECTURES, read_config, spec_from_config
from models.weights import ModelWeights

SUPPORTED_ARCHITECTURES = tuple(sorted(ARCHITECTURES))


def _dtype_from_tensors(root: Path):
    """For a config without dtype/torch_dtype: the dtype the tensors are stored in, if readable."""

    def peek():
        try:
            from models.hf_weights import SafetensorsDir

            return SafetensorsDir(root).float_dtype()
        except UserError:
            return None

    return peek


def import_spec(path: str | Path) -> ModelSpec:
    """Read `<path>/config.json` into a ModelSpec whose weights point back at `path`."""
    path = Path(path)
    data, cfg_path = read_config(path)
    root = cfg_path.parent
    spec = spec_from_config(data, str(cfg_path), name=root.resolve().name, path=str(root),
                            dtype_fallback=_dtype_from_tensors(root))
    # transformers' generate stops at generation_config.json's eos_token_id when the file sets one, not config.json's
    from models.generation_config import read_generation_config
    gen = read_generation_config(root)
    if gen is not None and gen.eos_token_ids is not None and gen.eos_token_ids != spec.eos_token_ids:
        bad = [t for t in gen.eos_token_ids if t >= spec.vocab_size]
        if bad:
            raise UserError(f"{gen.source}: 'eos_token_id' {bad} outside the vocabulary 0..{spec.vocab_size - 1}")
        spec = spec.model_copy(update={"eos_token_ids": gen.eos_token_ids})
    return spec


def check_checkpoint(path: str | Path, require_weights: bool = True, spec: Optional[ModelSpec] = None) -> Optional[str]:
    """Header-only validation of a checkpoint directory, reading no tensor data: config.json imports, every
    safetensors header is well-formed and its tensors' bytes are inside the file (a truncated copy fails), and
    every tensor the model needs is present with the expected shape (the checks `load_checkpoint` makes, so a
    bad checkpoint fails in `dataflow compile`, not in every rank of `dataflow run`). `spec`: the model spec
    that points at the directory (a YAML with `weights.source: checkpoint`), which must need the same tensors.
    A directory with no weight files at all: a UserError, or with `require_weights=False` a note to show (a
    plan can be compiled from config.json alone, e.g. to size a published model)."""
    from models.hf_weights import SafetensorsDir, has_weight_files, load_tensors
    from models.weights import expected_shapes

    ckpt_spec = import_spec(path)
    root = Path(ckpt_spec.weights.path)
    if spec is not None:
        want, have = expected_shapes(spec), expected_shapes(ckpt_spec)
        for name in sorted(set(want) | set(have), key=lambda n: (n not in want, n)):
            if want.get(name) != have.get(name):
                found = list(have[name]) if name in have else "no such tensor"
                expected = list(want[name]) if name in want else "no such tensor"
                raise UserError(f"{spec.name}: weights.path {root}: its config.json gives tensor '{name}' shape "
                                f"{found}, the spec needs {expected}; the spec and the checkpoint disagree")
    if not has_weight_files(root):
        msg = f"{root}: no *.safetensors files (and no model.safetensors.index.json)"
        if require_weights:
            raise UserError(f"{msg}; running the model needs its weights there")
        return f"{msg}: the plan can be inspected, but `dataflow run` needs the weights there"
    load_tensors(ckpt_spec, SafetensorsDir(root), check_only=True)
    return None


def load_checkpoint(path: str | Path, experts=None) -> tuple[ModelSpec, ModelWeights]:
    """The spec of `path` and its weights mapped to canonical names, in spec.dtype. `experts`: per
    layer the routed experts to read (models.weights.held_per_layer; None = all), e.g. a rank's."""
    from models.hf_weights import SafetensorsDir, load_tensors

    spec = import_spec(path)
    st = SafetensorsDir(Path(spec.weights.path))
    return spec, load_tensors(spec, st, experts)
