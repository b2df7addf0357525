"""Hugging Face checkpoint directory (config.json + safetensors) -> (ModelSpec, ModelWeights).

    import_spec(dir)      config.json only -> ModelSpec (weights.source = checkpoint, path = dir); the stop ids are
                          generation_config.json's eos_token_id when it sets one (as in transformers' generate)
    load_checkpoint(dir, experts=None)  -> (ModelSpec, ModelWeights in spec.dtype), every tensor
                          shape-checked; `experts`: only these routed experts per layer (a rank's)
    check_checkpoint(dir, spec=...)  header-only checks, and a spec naming the checkpoint (a YAML with
                          weights.source checkpoint) compared field by field with what config.json implies

The config translation lives in models/hf_config.py, the tensor mapping in models/hf_weights.py.
Supported architectures: see `SUPPORTED_ARCHITECTURES`. Everything a user can get wrong (no
config.json, unknown architecture, an unsupported setting, a missing or mis-shaped tensor) is a
`UserError` naming the file and the key or tensor.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec
from models.hf_config import ARCHITECTURES, eos_in_vocab, read_config, spec_from_config
from models.weights import ModelWeights

SUPPORTED_ARCHITECTURES = tuple(sorted(ARCHITECTURES))


def _dtype_from_tensors(root: Path) -> Optional[str]:
    """For a config without dtype/torch_dtype: the dtype the tensors are stored in, if readable."""
    from models.hf_weights import SafetensorsDir

    try:
        return SafetensorsDir(root).float_dtype()
    except UserError:
        return None


def import_spec(path: str | Path) -> ModelSpec:
    """Read `<path>/config.json` into a ModelSpec whose weights point back at `path`."""
    data, cfg_path = read_config(path)
    root = cfg_path.parent
    spec = spec_from_config(data, str(cfg_path), name=root.resolve().name, path=str(root),
                            dtype_fallback=lambda: _dtype_from_tensors(root))
    # transformers' generate stops at generation_config.json's eos_token_id when the file sets one, not config.json's
    from models.generation_config import read_generation_config
    gen = read_generation_config(root)
    if gen is not None and gen.eos_token_ids is not None and gen.eos_token_ids != spec.eos_token_ids:
        # (a tiny test vocabulary with a real tokenizer's ids: dropped with a warning, as transformers does)
        spec = spec.model_copy(update={"eos_token_ids": eos_in_vocab(gen.eos_token_ids, spec.vocab_size, gen.source)})
    return spec


class SpecCheckpointMismatch(UserError):
    """A spec that names a checkpoint says something its config.json does not (`spec_mismatches`)."""


# Fields a spec naming a checkpoint may set differently from what config.json implies: they change no tensor and no
# forward-pass math (the name, where the weights are, the stop ids, the longest sequence served, the compute dtype
# the checkpoint's tensors are cast to).
_FREE_FIELDS = ("name", "weights", "eos_token_ids", "max_position", "dtype")


def _math_view(spec: ModelSpec) -> dict:
    """The spec's math-relevant fields, flattened to dotted names, each as the math reads it: the softmax scale
    actually used, the rope mscale pair only where YaRN uses it, the per-layer sliding window."""
    from models.attention import softmax_scale

    data = spec.model_dump(exclude=set(_FREE_FIELDS))
    a, rope = data["attention"], data["attention"]["rope"]
    a["softmax_scale"] = softmax_scale(spec.attention)
    pair = rope["scaling"] == "yarn" and rope["mscale"] is not None and rope["mscale_all_dim"] is not None
    rope["mscale"] = (rope["mscale"], rope["mscale_all_dim"]) if pair else None
    del rope["mscale_all_dim"]  # the rest of its effect is in the softmax scale
    a["sliding_window"] = [spec.attention.window(l) for l in range(spec.num_layers)]
    del a["layer_types"]
    data["dense_layers"] = sorted(data["dense_layers"])
    out: dict = {}

    def walk(prefix: str, node) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                out[prefix + k] = v
    walk("", data)
    return out


def _same(a, b) -> bool:
    # A YAML author writes a derived float (a softmax scale, an eps) to a few digits fewer than Python prints it.
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _shown(field: str, value) -> str:
    if field == "attention.sliding_window":
        # The per-layer windows, stated as the spec's own fields would say them.
        if len(set(value)) == 1:
            return "no sliding window" if value[0] is None else f"window {value[0]} on every layer"
        return "per layer " + str(["full" if w is None else w for w in value])
    if field == "attention.rope.mscale" and isinstance(value, tuple):
        return f"mscale {value[0]:g} / mscale_all_dim {value[1]:g}"
    if isinstance(value, float):
        return f"{value:.7g}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "unset" if value is None else str(value)


def spec_mismatches(spec: ModelSpec, ckpt_spec: ModelSpec) -> list[tuple[str, str, str]]:
    """(field, the spec's value, the checkpoint's) for every math-relevant field where `spec` (a YAML naming the
    checkpoint) and `ckpt_spec` (what its config.json implies, models.hf_config.spec_from_config) differ."""
    mine, theirs = _math_view(spec), _math_view(ckpt_spec)
    return [(field, _shown(field, mine.get(field)), _shown(field, theirs.get(field)))
            for field in dict.fromkeys([*mine, *theirs]) if not _same(mine.get(field), theirs.get(field))]


def check_spec_matches(spec: ModelSpec, ckpt_spec: ModelSpec, config: str, source: Optional[str] = None) -> None:
    """Refuse a spec that names a checkpoint but says something else than its config.json: the weights would be
    run under other math (a Mixtral checkpoint under the default rope theta diverges after a few tokens)."""
    bad = spec_mismatches(spec, ckpt_spec)
    if not bad:
        return
    who = "the YAML" if source else "the spec"
    shown = "; ".join(f"field '{f}': {who} says {a}, {config} says {b}" for f, a, b in bad[:5])
    more = f"; and {len(bad) - 5} more fields" if len(bad) > 5 else ""
    raise SpecCheckpointMismatch(f"{source or spec.name}: {shown}{more}; the spec must say what the checkpoint "
                                 f"is (or compile the checkpoint directory itself)")


def check_checkpoint(path: str | Path, require_weights: bool = True, spec: Optional[ModelSpec] = None,
                     source: Optional[str] = None) -> Optional[str]:
    """Header-only validation of a checkpoint directory, reading no tensor data: config.json imports, every
    safetensors header is well-formed and its tensors' bytes are inside the file (a truncated copy fails), and
    every tensor the model needs is present with the expected shape (the checks `load_checkpoint` makes, so a
    bad checkpoint fails in `dataflow compile`, not in every rank of `dataflow run`). `spec`: the model spec
    that points at the directory (a YAML with `weights.source: checkpoint`), which must need the same tensors.
    A directory with no weight files at all: a UserError, or with `require_weights=False` a note to show (a
    plan can be compiled from config.json alone, e.g. to size a published model). `source`: the YAML file `spec`
    was read from, named in the errors (else the spec's name); a field that disagrees with config.json is a
    `SpecCheckpointMismatch`."""
    from models.hf_weights import SafetensorsDir, has_weight_files, load_tensors

    ckpt_spec = import_spec(path)
    root = Path(ckpt_spec.weights.path)
    if spec is not None:
        # every field a tensor shape depends on is compared here, so the spec then needs the checkpoint's tensors
        check_spec_matches(spec, ckpt_spec, str(root / "config.json"), source)
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
    return spec, load_tensors(spec, SafetensorsDir(spec.weights.path), experts)
