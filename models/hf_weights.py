"""Hugging Face safetensors tensors -> canonical `ModelWeights` names and layouts.

Layouts accepted for the routed experts (all checked against what transformers 5.24 reads/writes):
- per-expert (published checkpoints, and what `save_pretrained` writes back for every family but GPT-OSS, because
  transformers reverses its load-time fusion on save): `{moe}.experts.{e}.gate_proj/up_proj/down_proj.weight`;
  Mixtral uses `block_sparse_moe.experts.{e}.w1/w3/w2`.
- fused, as transformers 5 holds them in memory (`model.state_dict()`): `mlp.experts.gate_up_proj [E, 2I, H]` (gate
  rows first, then up: `.chunk(2, dim=-1)` of the output) and `mlp.experts.down_proj [E, H, I]`.
- GPT-OSS: `mlp.experts.gate_up_proj [E, H, 2I]` -- transposed relative to a Linear, used as `x @ W`, gate and up
  *interleaved* along the last dim (gate = [..., ::2], up = [..., 1::2]) -- with `gate_up_proj_bias [E, 2I]` (same
  interleave), `down_proj [E, I, H]`, `down_proj_bias [E, H]`; or the published MXFP4 form
  `*_blocks [E, out, in/32, 16] uint8` + `*_scales [E, out, in/32] uint8`, whose rows are already in Linear
  `[out, in]` order (transformers transposes after dequantizing).

Every source tensor is shape-checked *before* it is transformed, so a wrong checkpoint fails with the file, the HF
tensor name, the canonical name and expected vs found shape, never with a torch error from a stack or a slice.

A subset of the routed experts (`load_tensors(..., experts=)`, a rank's shard) reads only those: per-expert tensors
of other experts are shape-checked from the header and skipped; fused tensors are read by row ranges of dim 0
(safetensors slices lazily), then transformed like the full ones.
"""
from __future__ import annotations

import itertools
import json
import math
import re
import struct
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec
from models.hf_families import MTP_FAMILIES
from models.weights import (ExpertSubset, ModelWeights, expected_shapes, held_per_layer, torch_dtype,
                            validate_weights)

_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

# MXFP4 (OCP microscaling FP4 E2M1): a nibble indexes this table; the scale byte is a biased exponent.
_FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

# Bytes per element of the safetensors dtypes (sub-byte and unknown dtypes: only the bounds are checked).
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor names -> dtype, shape, offsets; its __metadata__ dropped)
    without reading tensor data, checked against the file: every entry well-formed, its byte range the size of its
    shape x dtype, and inside the file (a truncated download fails here, naming the first tensor whose bytes are
    missing)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise UserError(f"{path}: not a safetensors file ({size} bytes, too short for a header)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise UserError(f"{path}: not a safetensors file (header length {n})")
            if 8 + n > size:
                raise UserError(f"{path}: truncated: the header needs {8 + n} bytes, the file has {size}")
            text = f.read(n)
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)  # (free-form strings, no tensor)
    data_len = size - 8 - n
    cut: list[tuple[int, int, str]] = []  # (begin, end, name) of tensors whose bytes run past the end of the file
    for name, info in header.items():
        where = f"{path}: tensor '{name}'"
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) \
                or not isinstance(info.get("shape"), list) or not isinstance(info.get("data_offsets"), list):
            raise UserError(f"{where}: header entry {str(info)[:80]!r} is not {{dtype, shape, data_offsets}}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise UserError(f"{where}: shape {shape} is not a list of non-negative integers")
        if len(offsets) != 2 or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) \
                or not 0 <= offsets[0] <= offsets[1]:
            raise UserError(f"{where}: data_offsets {offsets} is not [begin, end] with 0 <= begin <= end")
        itemsize = _ST_ITEMSIZE.get(info["dtype"])
        numel = math.prod(shape)
        if itemsize is not None and offsets[1] - offsets[0] != numel * itemsize:
            raise UserError(f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, shape {shape} "
                            f"of {info['dtype']} needs {numel * itemsize}")
        if offsets[1] > data_len:
            cut.append((offsets[0], offsets[1], name))
    if cut:
        begin, end, name = min(cut)
        missing = max(c[1] for c in cut) - data_len
        raise UserError(f"{path}: truncated: {missing} bytes missing at the end ({size} bytes, the header needs "
                        f"{size + missing}); tensor '{name}' is the first cut off ({len(cut)} in all); copy the "
                        f"checkpoint again")
    return header


def has_weight_files(root: str | Path) -> bool:
    """Whether a checkpoint directory has any weights (safetensors files or an index) at all."""
    root = Path(root)
    return (root / "model.safetensors.index.json").is_file() or any(root.glob("*.safetensors"))


class SafetensorsDir:
    """All tensors of a checkpoint directory: one file, several, or sharded with an index."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        index = self.root / "model.safetensors.index.json"
        self.file_of: dict[str, Path] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        self.dtype_of: dict[str, str] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                raise UserError(f"{index}: not a safetensors index (needs a 'weight_map' object)") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise UserError(f"{index}: field 'weight_map': expected an object of tensor name -> shard file name")
            files = sorted(set(weight_map.values()))
            for fname in files:
                if not (self.root / fname).is_file():
                    raise UserError(f"{index}: lists shard '{fname}', which is not in {self.root}")
        else:
            files = sorted(p.name for p in self.root.glob("*.safetensors"))
            if not files:
                raise UserError(f"{self.root}: no *.safetensors files (and no model.safetensors.index.json); "
                                f"only safetensors checkpoints are supported")
        for fname in files:
            path = self.root / fname
            for name, info in _read_header(path).items():
                if name in self.file_of:
                    raise UserError(f"{self.root}: tensor '{name}' is in both {self.file_of[name].name} and {fname}")
                self.file_of[name] = path
                self.shape_of[name] = tuple(info["shape"])
                self.dtype_of[name] = info["dtype"]
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def float_dtype(self) -> Optional[str]:
        """The dtype most floating tensors are stored in (for configs that do not say)."""
        # (fp8 scales are fp32 whatever the model)
        counts = Counter(_ST_DTYPES[dt] for name, dt in self.dtype_of.items()
                         if dt in _ST_DTYPES and not name.endswith("_scale_inv"))
        return max(counts, key=counts.get) if counts else None

    def _handle(self, name: str):
        from safetensors import safe_open

        path = self.file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def get(self, name: str) -> Tensor:
        return self._handle(name).get_tensor(name)

    def get_rows(self, name: str, rows: list[int]) -> Tensor:
        """Rows `rows` (sorted) of dim 0 of tensor `name`, reading only those: one slice per run of
        consecutive rows (a contiguous placement reads one range per rank)."""
        sl = self._handle(name).get_slice(name)
        if not rows:
            return sl[0:0]  # no expert of this layer held here: zero rows, same trailing dims
        # a run of consecutive rows has one row - index for all of its rows
        runs = [[r for _, r in run] for _, run in itertools.groupby(enumerate(rows), lambda p: p[1] - p[0])]
        parts = [sl[run[0]:run[-1] + 1] for run in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class _Loader:
    """Fetches HF tensors for one spec, checking each source shape and recording what was used."""

    def __init__(self, spec: ModelSpec, st: SafetensorsDir, experts: ExpertSubset = None, dry: bool = False):
        self.spec, self.st = spec, st
        self.dry = dry  # check only: every tensor comes back as an empty 'meta' tensor of its header's shape
        self.want = expected_shapes(spec)  # full shapes: what the checkpoint must contain
        self.held = held_per_layer(spec, experts)
        self.used: set[str] = set()
        self.out: dict[str, Tensor] = {}
        self.fp8_block = _fp8_block(st.root)

    def where(self, name: str) -> str:
        return str(self.st.file_of.get(name, self.st.root))

    def has(self, name: str) -> bool:
        return name in self.st

    def check(self, hf: str, shape: tuple[int, ...], canon: str) -> None:
        """Header-only: `hf` exists with `shape`; marks it used (a skipped expert is not 'unexpected')."""
        if hf not in self.st:
            raise UserError(f"{self.st.root}: missing tensor '{hf}' (for '{canon}', expected shape {list(shape)})")
        found = self.st.shape_of[hf]
        if tuple(found) != tuple(shape):
            raise UserError(f"{self.where(hf)}: tensor '{hf}' (for '{canon}') has shape {list(found)}, "
                            f"expected {list(shape)}")
        self.used.add(hf)

    def _scale_of(self, hf: str, shape: tuple[int, ...], canon: str) -> Optional[str]:
        """The `weight_scale_inv` of an fp8 tensor (checked: present, one entry per block), None if not fp8."""
        if self.st.dtype_of.get(hf) != "F8_E4M3":
            return None
        scale = hf.removesuffix(".weight") + ".weight_scale_inv" if hf.endswith(".weight") else hf + "_scale_inv"
        if self.fp8_block is None:
            raise UserError(f"{self.where(hf)}: tensor '{hf}' is fp8 but config.json has no quantization_config "
                            f"with quant_method fp8 and weight_block_size")
        bo, bi = self.fp8_block
        blocks = tuple(shape[:-2]) + (-(-shape[-2] // bo), -(-shape[-1] // bi))
        self.check(scale, blocks, canon + " (fp8 scale)")
        return scale

    def take(self, hf: str, shape: tuple[int, ...], canon: str, layer: Optional[int] = None) -> Tensor:
        """`hf`, checked, read and dequantized; with `layer`, a fused [E, ...] tensor of that layer: every row, or
        only the held experts' rows."""
        self.check(hf, shape, canon)
        scale = self._scale_of(hf, shape, canon)
        if self.dry:
            return torch.empty(self.st.shape_of[hf], device="meta")
        held = None if layer is None else self.held[layer]
        get = self.st.get if held is None else (lambda name: self.st.get_rows(name, held))
        return get(hf) if scale is None else _dequant_fp8(get(hf), get(scale), self.fp8_block)

    def direct(self, hf: str, canon: str) -> None:
        """Copy one HF tensor to `canon` unchanged (same [out, in] layout)."""
        self.out[canon] = self.take(hf, self.want[canon], canon)


def fp8_block_size(data: dict, source: str) -> Optional[tuple[int, int]]:
    """(rows, cols) of a block-scaled fp8 checkpoint's scale blocks (quantization_config.weight_block_size, DeepSeek-V3:
    128 x 128), None when the config does not quantize to fp8. Only e4m3 weights with per-block `weight_scale_inv`
    are read."""
    qc = data.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UserError(f"{source}: 'quantization_config.fmt' = {fmt!r} is not supported by dataflow (supported: e4m3)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UserError(f"{source}: 'quantization_config.weight_block_size' = {block!r}: dataflow reads block-scaled "
                        f"fp8 only, valid: two positive integers (DeepSeek-V3: [128, 128])")
    return block[0], block[1]


def _fp8_block(root: Path) -> Optional[tuple[int, int]]:
    """The checkpoint's fp8 block shape from its config.json (models.hf_config.fp8_block_size), None if not fp8."""
    from models.hf_config import read_config

    try:
        data, path = read_config(root)
    except UserError:
        return None  # a bare safetensors directory: an fp8 tensor in it is refused by _Loader._scale_of
    return fp8_block_size(data, str(path))


def _dequant_fp8(w: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """DeepSeek-V3 block-scaled fp8: [..., O, I] float8_e4m3fn times its block's entry of scale_inv
    [..., ceil(O/bo), ceil(I/bi)] -> fp32 (exact: an e4m3 value times an fp32 scale rounds once, in fp32); the
    loader then casts to the spec's dtype, so the model runs dequantized weights (bf16 for a published checkpoint)."""
    bo, bi = block
    o, i = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(bo, dim=-2)[..., :o, :].repeat_interleave(bi, dim=-1)[..., :i]
    return w.float() * s


def _dequant_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """[..., G, 16] uint8 blocks + [..., G] uint8 scales -> [..., G*32] fp32, same math as
    transformers' `convert_moe_packed_tensors` (low nibble first; value * 2**(scale - 127)).
    Exact: FP4 values times powers of two fit fp32 (and bf16) without rounding."""
    if blocks.is_meta:  # a header-only check (load_tensors(check_only=True)): the shape is all there is
        return torch.empty(blocks.shape[:-2] + (blocks.shape[-2] * 32,), device="meta")
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return vals.flatten(-2)


def _experts(ld: _Loader, layer: int, moe: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
             fused: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")) -> None:
    """Routed experts of `layer` under prefix `moe` (e.g. `model.layers.3.mlp`), per-expert or fused.
    `names`: the per-expert (gate, up, down) module names; `fused`: the names of the fused [E, 2I, H] gate-then-up
    and [E, H, I] down tensors."""
    c = f"layers.{layer}."
    E, I, H = ld.want[c + "experts.gate"]
    gu_name, down_name = (f"{moe}.{n}" for n in fused)
    if ld.has(gu_name):
        gu = ld.take(gu_name, (E, 2 * I, H), c + "experts.gate/up", layer)
        ld.out[c + "experts.gate"], ld.out[c + "experts.up"] = gu[:, :I], gu[:, I:]
        ld.out[c + "experts.down"] = ld.take(down_name, (E, H, I), c + "experts.down", layer)
        return
    held = ld.held[layer]
    ids = range(E) if held is None else held
    for canon, mod in zip(("gate", "up", "down"), names):
        shape = ld.want[c + f"experts.{canon}"][1:]
        for e in set(range(E)) - set(ids):  # other ranks' experts: checked, not read
            ld.check(f"{moe}.experts.{e}.{mod}.weight", shape, c + f"experts.{canon}[{e}]")
        ld.out[c + f"experts.{canon}"] = torch.stack(
            [ld.take(f"{moe}.experts.{e}.{mod}.weight", shape, c + f"experts.{canon}[{e}]") for e in ids]) \
            if ids else torch.empty((0,) + shape)


def _gpt_oss_experts(ld: _Loader, layer: int, moe: str) -> None:
    c = f"layers.{layer}."
    E, I, H = ld.want[c + "experts.gate"]
    gu_name, down_name = f"{moe}.experts.gate_up_proj", f"{moe}.experts.down_proj"
    if ld.has(gu_name + "_blocks") or ld.has(down_name + "_blocks"):
        # MXFP4: dequantize to Linear layout [E, out, in]; the fused rows interleave gate/up.
        def mx(base: str, out_dim: int, in_dim: int, canon: str) -> Tensor:
            if in_dim % 32:
                raise UserError(f"{ld.where(base + '_blocks')}: MXFP4 tensor '{base}_blocks' needs an input dim "
                                f"divisible by 32, the spec gives {in_dim}")
            blocks = ld.take(base + "_blocks", (E, out_dim, in_dim // 32, 16), canon, layer)
            scales = ld.take(base + "_scales", (E, out_dim, in_dim // 32), canon, layer)
            return _dequant_mxfp4(blocks, scales)

        gu = mx(gu_name, 2 * I, H, c + "experts.gate/up")  # [E, 2I, H]
        ld.out[c + "experts.gate"], ld.out[c + "experts.up"] = gu[:, 0::2], gu[:, 1::2]
        ld.out[c + "experts.down"] = mx(down_name, H, I, c + "experts.down")  # [E, H, I]
    else:
        gu = ld.take(gu_name, (E, H, 2 * I), c + "experts.gate/up", layer)  # x @ W layout
        ld.out[c + "experts.gate"] = gu[..., 0::2].transpose(1, 2)
        ld.out[c + "experts.up"] = gu[..., 1::2].transpose(1, 2)
        ld.out[c + "experts.down"] = ld.take(down_name, (E, I, H), c + "experts.down", layer).transpose(1, 2)
    gub = ld.take(gu_name + "_bias", (E, 2 * I), c + "experts.gate_b/up_b", layer)
    ld.out[c + "experts.gate_b"], ld.out[c + "experts.up_b"] = gub[:, 0::2], gub[:, 1::2]
    ld.out[c + "experts.down_b"] = ld.take(down_name + "_bias", (E, H), c + "experts.down_b", layer)


# Canonical attention tensor -> HF name under `{layer}.self_attn.`; each is read where the spec needs it.
_GQA_NAMES = {"q.w": "q_proj.weight", "q.b": "q_proj.bias", "k.w": "k_proj.weight", "k.b": "k_proj.bias",
              "v.w": "v_proj.weight", "v.b": "v_proj.bias", "o.w": "o_proj.weight", "o.b": "o_proj.bias",
              "q_norm": "q_norm.weight", "k_norm": "k_norm.weight", "sinks": "sinks"}
# Hunyuan-MoE's q / k norms are query_layernorm / key_layernorm
_HUNYUAN_NAMES = {**_GQA_NAMES, "q_norm": "query_layernorm.weight", "k_norm": "key_layernorm.weight"}
_MLA_NAMES = {"q.w": "q_proj.weight", "q_a.w": "q_a_proj.weight", "q_a.b": "q_a_proj.bias",
              "q_a_norm": "q_a_layernorm.weight", "q_b.w": "q_b_proj.weight",
              "kv_a.w": "kv_a_proj_with_mqa.weight", "kv_a.b": "kv_a_proj_with_mqa.bias",
              "kv_a_norm": "kv_a_layernorm.weight", "kv_b.w": "kv_b_proj.weight",
              "o.w": "o_proj.weight", "o.b": "o_proj.bias"}


def _attention(ld: _Loader, layer: int, p: str) -> None:
    c = f"layers.{layer}."
    names = _MLA_NAMES if ld.spec.attention.kind == "mla" else \
        _HUNYUAN_NAMES if ld.spec.family == "hunyuan_v1_moe" else _GQA_NAMES
    for canon, hf in names.items():
        if c + canon in ld.want:
            ld.direct(f"{p}.self_attn.{hf}", c + canon)


def _mlp(ld: _Loader, layer: int, p: str) -> None:
    fam, c = ld.spec.family, f"layers.{layer}."
    if not ld.spec.is_moe_layer(layer):
        for canon in ("gate", "up", "down"):
            ld.direct(f"{p}.mlp.{canon}_proj.weight", c + f"mlp.{canon}")
        return
    if fam == "gpt_oss":
        ld.direct(f"{p}.mlp.router.weight", c + "router.w")
        ld.direct(f"{p}.mlp.router.bias", c + "router.b")
        _gpt_oss_experts(ld, layer, f"{p}.mlp")
        return
    if fam == "granitemoe":
        # Published and saved GraniteMoE: block_sparse_moe.{router.layer, input_linear [E, 2I, H] (gate rows, then
        # up), output_linear [E, H, I]}; transformers 5 holds them as router.weight / experts.gate_up_proj/down_proj.
        moe = f"{p}.block_sparse_moe"
        if ld.has(f"{moe}.input_linear.weight"):
            ld.direct(f"{moe}.router.layer.weight", c + "router.w")
            _experts(ld, layer, moe, fused=("input_linear.weight", "output_linear.weight"))
        else:
            ld.direct(f"{moe}.router.weight", c + "router.w")
            _experts(ld, layer, moe)
        return
    if fam in ("mixtral", "minimax_m2"):
        # Published Mixtral and MiniMax-M2: block_sparse_moe.{gate, experts.e.w1/w3/w2} (+ MiniMax's
        # e_score_correction_bias); transformers 5 renames the block to mlp in memory. w1 = gate, w3 = up, w2 = down.
        moe = f"{p}.block_sparse_moe" if ld.has(f"{p}.block_sparse_moe.gate.weight") else f"{p}.mlp"
        ld.direct(f"{moe}.gate.weight", c + "router.w")
        if fam == "minimax_m2":
            ld.direct(f"{moe}.e_score_correction_bias", c + "router.correction_bias")
        _experts(ld, layer, moe, ("w1", "w3", "w2"))
        return
    moe = f"{p}.mlp"
    ld.direct(f"{moe}.gate.wg.weight" if fam == "hunyuan_v1_moe" else f"{moe}.gate.weight", c + "router.w")
    if fam == "ernie4_5_moe":  # saved as moe_statics [1, E]; transformers 5 holds it under gate.moe_statics
        hf = next((n for n in (f"{moe}.moe_statics.e_score_correction_bias",
                               f"{moe}.gate.moe_statics.e_score_correction_bias") if ld.has(n)), f"{moe}.moe_statics")
        ld.out[c + "router.correction_bias"] = ld.take(hf, (1,) + ld.want[c + "router.correction_bias"],
                                                       c + "router.correction_bias").reshape(-1)
    elif c + "router.correction_bias" in ld.want:
        ld.direct(f"{moe}.gate.e_score_correction_bias", c + "router.correction_bias")
    _experts(ld, layer, moe)
    if c + "shared.gate" in ld.want:
        shared = {"qwen2_moe": "shared_expert", "hunyuan_v1_moe": "shared_mlp"}.get(fam, "shared_experts")
        for canon in ("gate", "up", "down"):
            ld.direct(f"{moe}.{shared}.{canon}_proj.weight", c + f"shared.{canon}")
    if c + "shared_gate.w" in ld.want:
        ld.direct(f"{moe}.shared_expert_gate.weight", c + "shared_gate.w")


def _ignorable(spec: ModelSpec, name: str, tied: bool) -> bool:
    """Tensors a checkpoint may carry that the model never reads (HF ignores them on load too)."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return (name.endswith(".rotary_emb.inv_freq")  # buffers some older checkpoints saved
            or (tied and name == "lm_head.weight")  # transformers ties and ignores a saved copy
            # ERNIE-4.5's multi-token-prediction block: transformers ignores every name containing "mtp"
            or (spec.family == "ernie4_5_moe" and "mtp" in name)
            # GLM-4.5's / DeepSeek-V3's / GLM-4.7-Flash's multi-token-prediction layers (num_nextn_predict_layers)
            # follow the decoder layers; transformers ignores them for causal LM and so do we.
            or bool(layer and int(layer.group(1)) >= spec.num_layers and spec.family in MTP_FAMILIES))


def load_tensors(spec: ModelSpec, st: SafetensorsDir, experts: ExpertSubset = None,
                 check_only: bool = False) -> Optional[ModelWeights]:
    """Map the checkpoint's tensors onto `spec`'s canonical names, cast to `spec.dtype`.
    `experts`: read only these routed experts per layer (see models.weights.held_per_layer).
    `check_only`: read no tensor data, only run every header check the load would (each needed tensor present
    with its shape, none unexpected) and return None."""
    ld = _Loader(spec, st, experts, dry=check_only)
    ld.direct("model.embed_tokens.weight", "embed")
    ld.direct("model.norm.weight", "final_norm")
    if "lm_head" in ld.want:
        ld.direct("lm_head.weight", "lm_head")
    for layer in range(spec.num_layers):
        p, c = f"model.layers.{layer}", f"layers.{layer}."
        ld.direct(f"{p}.input_layernorm.weight", c + "attn_norm")
        ld.direct(f"{p}.post_attention_layernorm.weight", c + "mlp_norm")
        _attention(ld, layer, p)
        _mlp(ld, layer, p)

    unused = sorted(n for n in st.file_of if n not in ld.used and not _ignorable(spec, n, spec.tie_embeddings))
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise UserError(f"{ld.where(unused[0])}: unexpected tensor '{unused[0]}'{more} for a {spec.family} model "
                        f"as config.json describes it; the config and the weights disagree")
    if check_only:
        return None

    dtype = torch_dtype(spec.dtype)
    # contiguous(): slices/transposes above are views; callers expect plain dense tensors.
    ts = {k: v.contiguous() for k, v in ld.out.items()}
    w = ModelWeights.from_names(ts, spec.num_layers, held=None if experts is None else ld.held)
    # ModelWeights.to keeps the fp32-always tensors (router correction bias) in fp32.
    w = w.to(dtype=dtype)
    validate_weights(spec, w, source=str(st.root))
    return w
