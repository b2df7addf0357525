"""Hugging Face checkpoint directory (config.json + safetensors) -> (ModelSpec, ModelWeights).

    import_spec(dir)      config.json only -> ModelSpec (weights.source = checkpoint, path = dir)
    load_checkpoint(dir, experts=None)  -> (ModelSpec, ModelWeights in spec.dtype), every tensor
                          shape-checked; `experts`: only these routed experts per layer (a rank's)

The config translation lives in models/hf_config.py, the tensor mapping in models/hf_weights.py.
Supported architectures: see `SUPPORTED_ARCHITECTURES`. Everything a user can get wrong (no
config.json, unknown architecture, an unsupported setting, a missing or mis-shaped tensor) is a
`UserError` naming the file and the key or tensor.
"""
from __future__ import annotations

from pathlib import Path

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
    return spec_from_config(data, str(cfg_path), name=root.resolve().name, path=str(root),
                            dtype_fallback=_dtype_from_tensors(root))


def load_checkpoint(path: str | Path, experts=None) -> tuple[ModelSpec, ModelWeights]:
    """The spec of `path` and its weights mapped to canonical names, in spec.dtype. `experts`: per
    layer the routed experts to read (models.weights.held_per_layer; None = all), e.g. a rank's."""
    from models.hf_weights import SafetensorsDir, load_tensors

    spec = import_spec(path)
    st = SafetensorsDir(Path(spec.weights.path))
    return spec, load_tensors(spec, st, experts)
