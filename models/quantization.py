"""Quantised checkpoints: reading `quantization_config`, and the weight map of the projections it packs.

Quantisation is data, not a model: the builders ask `linear` for a product of a checkpoint module, and the
params made here say whether that module's weight is a float tensor or packed (ir.packing) over the checkpoint
tensors that hold it. Supported: AutoAWQ GEMM INT4 (`quant_method` awq, `bits` 4, `version` gemm,
`zero_point` true), as Qwen publishes its *-Instruct-AWQ checkpoints. A GGUF file's packed projections
(models.gguf) come as such a config too, with our own key `packed_modules`: module -> [kind, group, planes, block]
of those packed otherwise (ir.packing: float offsets for Q4_1 and Q4_K, planes for the wider blocks, two-level
scales for the K-quants).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ir import Packing, Param, TensorType
from ir.packing import AWQ_ORDER, AWQ_PACK, PACKINGS

from .config import ConfigReader

PROJECTION = "_proj.weight"  # the decoder's linear projections (q/k/v/o, gate/up/down): what AWQ packs


@dataclass(frozen=True)
class AwqQuantization:
    """A validated AWQ `quantization_config`: group size (-1: one group per input width), the modules left
    unquantised (a module whose name contains one of them keeps its float weight, as transformers reads it), and
    the modules packed otherwise than AWQ INT4 of that group, or packed though not projections (`packed_modules`, exact
    names: a GGUF file's embedding and head)."""

    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()
    packed_modules: tuple[tuple[str, Packing], ...] = ()
    quant_method: str = "awq"
    bits: int = 4
    version: str = "gemm"
    zero_point: bool = True

    def packing(self, weight: str, in_features: int) -> Packing | None:
        """How the checkpoint stores `module.weight` (of `in_features` input rows): its packing, or None (float)."""
        module = weight.removesuffix(".weight")
        own = dict(self.packed_modules).get(module)  # named: packed so, a projection or not (a GGUF file's head)
        if own or not weight.endswith(PROJECTION) or any(skip in module for skip in self.modules_to_not_convert):
            return own
        return Packing("awq_int4", in_features if self.group_size == -1 else self.group_size)


def awq_config(group: int, modules_to_not_convert: tuple[str, ...] = (),
               packed_modules: dict[str, Packing] | None = None) -> dict:
    """The quantization_config transformers writes for an AutoAWQ GEMM INT4 checkpoint of this group size (with
    `packed_modules`, our key for modules packed otherwise, if any)."""
    own = {module: [p.kind, p.group, p.planes, p.block] for module, p in (packed_modules or {}).items()}
    return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True,
            "modules_to_not_convert": list(modules_to_not_convert) or None} | ({"packed_modules": own} if own else {})


def awq_pack(values: np.ndarray) -> np.ndarray:
    """[rows, out] 4-bit values as int32 words [rows, out / 8]: nibble slot i of word c holds column 8c + AWQ_ORDER[i].
    Assembled from the [out, rows] view (a copy only where `values` is row-major), whole runs of rows at a time, then
    one transposing copy of the words."""
    rows, out = values.shape
    columns = values.T.astype(np.uint8, copy=False).reshape(out // AWQ_PACK, AWQ_PACK, rows)
    words = np.zeros((out // AWQ_PACK, rows), np.uint32)
    for slot, column in enumerate(AWQ_ORDER):
        words |= columns[:, column].astype(np.uint32) << np.uint32(4 * slot)
    return np.ascontiguousarray(words.T).view("<i4")


def read_quantization(cfg: ConfigReader) -> AwqQuantization | None:
    """The checkpoint's quantisation (None for a float checkpoint); anything but AutoAWQ GEMM INT4 is an error
    naming the field, its value and what is supported."""
    raw = cfg.raw.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise cfg.error("quantization_config", f"must be an object, got {raw!r}")
    q = _reader(cfg)
    method = q.get("quant_method")
    if not isinstance(method, str) or method.lower() != "awq":
        raise q.error("quant_method", f"is {method!r}; supported: 'awq' (AutoAWQ GEMM INT4)")
    bits = q.get("bits")
    if bits != 4 or isinstance(bits, bool):
        raise q.error("bits", f"is {bits!r}; supported: 4")
    version = q.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise q.error("version", f"is {version!r}; supported: 'gemm' (the GEMV, Marlin and ExLlama packings are not)")
    if q.get("zero_point", True) is not True:
        raise q.error("zero_point", f"is {q.get('zero_point', True)!r}; supported: true (asymmetric, with zeros)")
    group = q.get("group_size")
    if isinstance(group, bool) or not isinstance(group, int) or not (group > 0 or group == -1):
        raise q.error("group_size", f"is {group!r}; supported: a positive group size, or -1 (one group per row)")
    skip = q.get("modules_to_not_convert", [])
    if not isinstance(skip, list) or not all(isinstance(m, str) and m for m in skip):
        raise q.error("modules_to_not_convert", f"must be a list of module names, got {skip!r}")
    own = q.get("packed_modules", {})
    if not isinstance(own, dict) or not all(isinstance(v, list) and len(v) == 4 and v[0] in PACKINGS
                                            and all(isinstance(n, int) and n >= 0 for n in v[1:])
                                            and Packing(*v).problem((AWQ_PACK, v[3] or v[1])) is None
                                            for v in own.values()):
        raise q.error("packed_modules", f"must map module names to [kind, group, planes, block] (kinds: "
                                        f"{', '.join(PACKINGS)}), got {own!r}")
    return AwqQuantization(group, tuple(skip), tuple((m, Packing(*v)) for m, v in own.items()))


def check_groups(quant: AwqQuantization | None, shapes: Mapping[str, tuple[int, ...]], cfg: ConfigReader) -> None:
    """Every packed weight's input width must split into whole groups, and its outputs into whole words."""
    for name, shape in shapes.items():
        packing = _packing(quant, name, shape)
        if packing is not None and packing.problem(shape):
            raise _reader(cfg).error("group_size", f"is {quant.group_size}, but {name} [{shape[0]}, {shape[1]}] "
                                     f"cannot be packed: {packing.problem(shape)}")


def _reader(cfg: ConfigReader) -> ConfigReader:
    """A reader of the quantization_config object, whose errors name it."""
    return ConfigReader(cfg.raw["quantization_config"], f"{cfg.source}: quantization_config")


def _packing(quant: AwqQuantization | None, name: str, shape: tuple[int, ...]) -> Packing | None:
    """How weight `name` of float layout `shape` is stored: its packing, or None."""
    return None if quant is None or len(shape) != 2 else quant.packing(name, shape[1])


def _parts(name: str, packing: Packing, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The checkpoint tensors of packed weight `name` (`module.<part>`): their shapes and dtypes (scales float16)."""
    module = name.removesuffix(".weight")
    return {f"{module}.{part}": stored for part, stored in zip(packing.part_names,
                                                               packing.checkpoint_parts(shape, "float16"))}


def stored_shapes(shapes: Mapping[str, tuple[int, ...]], quant: AwqQuantization | None) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors and shapes of a model whose float layout is `shapes`: each packed `module.weight`
    becomes its parts (`module.qweight`, `module.qzeros` or `module.offsets`, `module.scales`)."""
    out = {}
    for name, shape in shapes.items():
        packing = _packing(quant, name, shape)
        if packing is None:
            out[name] = shape
            continue
        out |= {part: part_shape for part, (part_shape, _) in _parts(name, packing, shape).items()}
    return out


def packed_tensors(shapes: Mapping[str, tuple[int, ...]], quant: AwqQuantization | None) -> frozenset[str]:
    """The integer checkpoint tensors (packed words) among `stored_shapes`."""
    return frozenset(part for name, shape in shapes.items() if _packing(quant, name, shape) is not None
                     for part, (_, dtype) in _parts(name, _packing(quant, name, shape), shape).items()
                     if dtype == "int32")


def make_params(shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str], default: str,
                quant: AwqQuantization | None) -> dict[str, Param]:
    """The weight map: a param per float-layout weight in `shapes`, of its checkpoint dtype (`default` when not
    given); a packed one is typed by its packing, over its parts, in the dtype of its scales (two-level ones, int32
    words of float32 products: float32)."""
    params = {}
    for name, shape in shapes.items():
        packing = _packing(quant, name, shape)
        if packing is None:
            params[name] = Param(name, TensorType(shape, dtypes.get(name, default)))
            continue
        sources = tuple(_parts(name, packing, shape))
        dtype = "float32" if packing.block else dtypes.get(sources[2], default)
        params[name] = Param(name, TensorType(shape, dtype, packing), sources, packing.transform)
    return params
