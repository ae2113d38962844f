"""The contract between the compiler (writer) and the runtime (reader) of an artifact.

An artifact is a directory: `manifest.json` (a `Manifest`), `model.so` (the compiled Relax VM module),
`kernels.ptx` for CUDA builds, and `ir.json` / `ir.txt` (the program, for inspection). The manifest
records a SHA-256 of each module file, checked before the module is used or reused, and the build
options, so every "rebuild" hint is the exact command that rebuilds this artifact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import shlex
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from .errors import RudaError
from .graph import (
    AXIS_LIMITS,
    BLOCK,
    BUCKET_AXES,
    HISTORY,
    PAGES,
    PAGES_PER_ROW,
    PATCHES,
    ROWS,
    SLOTS,
    STATE_ROLES,
    TOKENS,
    Program,
)

FORMAT = 5
KIND = "ruda-artifact"  # what marks a directory as ours: only such a directory is ever replaced by a build
MANIFEST = "manifest.json"
MODULE = "model.so"
PTX_FILE = "kernels.ptx"
IR_FILE = "ir.json"
IR_TEXT = "ir.txt"
ARTIFACT_FILES = (MANIFEST, MODULE, PTX_FILE, IR_FILE, IR_TEXT)  # all a build writes: a folder of only these is a (damaged) artifact
DEFAULT_ROOT = Path("build")
ATTENTION_ENTRIES = {"fused": "step", "legacy": "step_gather"}  # paged attention path -> the step entry that runs it
CUDA_RUNTIME_LIBRARY = "libcudart.so.13"  # what the pinned TVM's CUDA loader links against (CUDA 13)
CUDA_LIBRARY_FOLDERS = ("lib64", "lib", "targets/x86_64-linux/lib")  # where a CUDA toolkit root keeps it
MODEL_PACKAGES = ("ir", "models")  # the model definitions: a change here changes the graph an artifact implements


def hidden_entry(step_entry: str) -> str:
    """The variant of a step entry whose output is each sequence's last row of the final normalised hidden states,
    not its logits: for steps after which no sequence's next token is wanted (a prompt's chunks before its last), so
    that they skip the vocabulary head (one read of its weights, the largest matrix of most models)."""
    return f"{step_entry}_hidden"


class ArtifactError(RudaError):
    """The artifact is missing, damaged, or was built for something else."""

    exit_code = 5


@dataclass(frozen=True)
class ParamSpec:
    """A param of the module: name, shape, dtype, and how the runtime makes it from the checkpoint (its source
    tensors, their dtypes, and the transform: ir.graph.WEIGHT_TRANSFORMS)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    sources: tuple[str, ...]
    source_dtypes: tuple[str, ...]
    transform: str
    packing: Union[str, None] = None
    """How a quantised weight is packed (ir.packing, e.g. awq_int4(g128)); its sources are the packing's parts."""


@dataclass(frozen=True)
class QuantizationSpec:
    """The checkpoint's quantisation, as its quantization_config gives it, and how many params it packs."""

    method: str
    bits: int
    version: str
    group_size: int
    packed_params: int


@dataclass(frozen=True)
class InputSpec:
    """One runtime input of a compiled entry: its role (ir.graph.INPUT_ROLES) and, for state, its layer; shape
    (ints, or symbolic dims the runtime binds) and dtype. The runtime passes inputs in this order, by role."""

    name: str
    role: str
    layer: Union[int, None]
    shape: tuple[Union[int, str], ...]
    dtype: str

    @property
    def is_state(self) -> bool:
        """Whether the runtime keeps this input between calls (caches, KV pages, recurrent states)."""
        return self.role in STATE_ROLES


@dataclass(frozen=True)
class OutputSpec:
    """What a VM function writes into the buffer its caller passes after the inputs: shape and dtype."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Buckets:
    """The shape specialisations built. Each entry is compiled over its bucket axes (ir.graph.BUCKET_AXES): a
    step's token buckets are the prefill chunk sizes and the row counts (a step of one token per sequence), its
    row buckets the sequence counts. A sequence holds up to `max_context` tokens in pages of `kv_block` tokens
    of the KV arena (`kv_pages` pages); recurrent states live in one slot per row of the largest step. An image
    encoder's patch buckets are `image_patches` (patches per call; none for a model without images).
    `entries`: the entries built (the model's non-optional ones, and the optional ones the build asked for)."""

    prefill_tokens: tuple[int, ...]
    batch_rows: tuple[int, ...]
    max_context: int
    kv_pages: int
    kv_block: int = 16
    entries: tuple[str, ...] = ("step", hidden_entry("step"))
    image_patches: tuple[int, ...] = ()

    @property
    def pages_per_row(self) -> int:
        """Block-table width: pages covering the longest sequence."""
        return -(-self.max_context // self.kv_block)

    @property
    def step_tokens(self) -> tuple[int, ...]:
        """Token buckets of steps: the prefill chunk sizes, and the row counts (a step of decodes only)."""
        return tuple(sorted(set(self.prefill_tokens) | set(self.batch_rows)))

    def sizes(self, axis: str) -> tuple[int, ...]:
        """The sizes a bucket axis is compiled for."""
        return {TOKENS: self.step_tokens, ROWS: self.batch_rows, PATCHES: self.image_patches}[axis]

    def functions(self, program: Program) -> list[tuple[str, str, dict[str, int]]]:
        """(VM function name, entry name, dim bindings) for every built entry and combination of the sizes of its
        bucket axes (a size at most its AXIS_LIMITS axis' size), the dims derived from them bound too."""
        out = []
        for entry in self.entries:
            graph = program.entries[entry]
            for sizes in itertools.product(*(self.sizes(axis) for axis in graph.bucket_dims)):
                bound = dict(zip(graph.bucket_dims, sizes))
                if all(bound[a] <= bound[limit] for a, limit in AXIS_LIMITS.items() if a in bound and limit in bound):
                    dims = {**bound, **graph.bind_derived(bound), **self.arena_dims()}
                    out.append((self.function_name(entry, bound), entry, dims))
        return out

    @staticmethod
    def function_name(entry: str, sizes: dict[str, int]) -> str:
        """The VM function of `entry` at these bucket sizes, e.g. step_t16_r1 (axes in BUCKET_AXES order, however the
        entry or the caller lists them)."""
        return "_".join([entry] + [f"{tag}{sizes[axis]}" for axis, tag in BUCKET_AXES.items() if axis in sizes])

    def arena_dims(self) -> dict[str, int]:
        """Bindings of the state dims: KV pages and their size, state slots (one per row of the largest step),
        block-table width and the positions it covers."""
        return {PAGES: self.kv_pages, BLOCK: self.kv_block, PAGES_PER_ROW: self.pages_per_row,
                HISTORY: self.pages_per_row * self.kv_block, SLOTS: self.batch_rows[-1]}


@dataclass(frozen=True)
class TargetSpec:
    """What the module was compiled for: `llvm` (a CPU model and the features it relies on) or `cuda`."""

    kind: str
    mtriple: str | None = None
    mcpu: str | None = None
    features: tuple[str, ...] = ()
    matmul_precision: str | None = None
    bf16_products: str | None = None
    """Where prefill products of bfloat16 weights ran in bfloat16: amx, avx512bf16, wmma (CUDA tensor cores), or None
    (float32)."""
    arch: str | None = None
    cuda_compiler: str | None = None
    ptx_version: str | None = None


TARGET_FIELDS = {"llvm": ("kind", "mtriple", "mcpu", "features", "matmul_precision", "bf16_products"),
                 "cuda": ("kind", "arch", "cuda_compiler", "ptx_version", "matmul_precision", "bf16_products")}


@dataclass(frozen=True)
class Manifest:
    """Everything the runtime needs to know about an artifact, and what decides whether a build is reused."""

    model_type: str
    built_from: str
    config_hash: str
    ir_hash: str
    model_code_hash: str
    """Hash of the model definitions (ir/, models/): the graph the module implements."""
    code_hash: str
    """Hash of all compiler source: a change to any kernel or schedule rebuilds."""
    tvm_version: str
    target: TargetSpec
    buckets: Buckets
    params: tuple[ParamSpec, ...]
    inputs: dict[str, tuple[InputSpec, ...]]
    """Each entry's runtime inputs in call order (shapes with the arena dims bound)."""
    vocab_size: int
    functions: dict[str, OutputSpec]
    """The VM functions by name, each with its output (see compiler.lower: inputs, output buffer, weights)."""
    kernels: tuple[str, ...]
    build_options: tuple[str, ...]
    """`compiler build` options (after MODEL_DIR, without --out) that reproduce this artifact."""
    quantization: Union[QuantizationSpec, None] = None
    """None for float weights."""
    files: dict[str, str] = field(default_factory=dict)
    """SHA-256 of each module file."""
    format: int = FORMAT
    kind: str = KIND

    def to_json(self) -> dict:
        """The manifest as a JSON-compatible dict (the target with the fields of its kind only)."""
        d = dataclasses.asdict(self)
        d["target"] = {k: v for k, v in d["target"].items() if k in TARGET_FIELDS[self.target.kind]}
        return d

    def same_build(self, other: "Manifest") -> bool:
        """Whether two manifests describe the same build (where it came from and its files aside)."""
        return dataclasses.replace(self, built_from="", files={}) == dataclasses.replace(other, built_from="", files={})


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def source_hash(packages: tuple[str, ...]) -> str:
    """Hash of the Python source of these top-level packages of the project."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for package in packages:
        for path in sorted((root / package).glob("*.py")):
            h.update(f"{package}/{path.name}".encode() + path.read_bytes())
    return h.hexdigest()


def config_hash(raw_config: dict) -> str:
    """Hash of a config.json's content (key order and whitespace do not matter)."""
    return hashlib.sha256(json.dumps(raw_config, sort_keys=True).encode()).hexdigest()


def default_artifact_dir(model_dir: str | Path, target: str) -> Path:
    """Where `python -m compiler build MODEL_DIR --target T` writes by default (relative to the cwd)."""
    model_dir = Path(model_dir).resolve()
    tag = hashlib.sha256(str(model_dir).encode()).hexdigest()[:8]
    return DEFAULT_ROOT / f"{model_dir.name}-{tag}.{target}"


def build_command(model_dir: str | Path, target: str, artifact: str | Path | None = None,
                  options: tuple[str, ...] = ()) -> str:
    """The exact command that (re)builds the artifact at `artifact` (default: the default place) with `options`."""
    args = ["python", "-m", "compiler", "build", str(model_dir)]
    args += list(options) if "--target" in options else ["--target", target, *options]
    if artifact is not None and Path(artifact).resolve() != default_artifact_dir(model_dir, target).resolve():
        args += ["--out", str(artifact)]
    return shlex.join(args)


def check_built_for(m: Manifest, path: Path, checkpoint: tuple, tvm_version: str, rebuild: str) -> None:
    """The artifact at `path` must be built from this checkpoint (raw config.json, parsed config, tensor dtypes)
    and model code with this TVM; else an ArtifactError ending with the `rebuild` command."""
    raw_config, config, dtypes = checkpoint
    if m.model_type != config.model_type or m.config_hash != config_hash(raw_config):
        raise ArtifactError(f"{path} was built for another model or config.json "
                            f"(built from {m.built_from}); rebuild: {rebuild}")
    if m.tvm_version != tvm_version:
        raise ArtifactError(f"{path} was built with TVM {m.tvm_version}, this is TVM {tvm_version}; "
                            f"rebuild: {rebuild}")
    if m.model_code_hash != source_hash(MODEL_PACKAGES):
        raise ArtifactError(f"{path} was built by another version of the model code (ir/, models/); "
                            f"rebuild: {rebuild}")
    changed = [f"{name} is {dtypes.get(name)} here, {dtype} in the artifact" for p in m.params
               for name, dtype in zip(p.sources, p.source_dtypes) if dtypes.get(name) != dtype]
    if changed:
        raise ArtifactError(f"{path} was built for other weights ({changed[0]}); rebuild: {rebuild}")


def read_manifest(artifact_dir: Path, rebuild: str) -> Manifest:
    """The manifest of the artifact at `artifact_dir`, or an ArtifactError ending with the `rebuild` command."""
    path = artifact_dir / MANIFEST
    if not path.is_file():
        if artifact_dir.exists() and not artifact_dir.is_dir():
            raise ArtifactError(f"{artifact_dir} is a file, not an artifact directory; pass the directory "
                                "`python -m compiler build` wrote")
        if artifact_dir.is_dir() and any(artifact_dir.iterdir()):
            raise ArtifactError(f"{artifact_dir} is not a compiled artifact (it has no {MANIFEST}); pass the directory "
                                "`python -m compiler build` wrote, or build one into a new directory")
        raise ArtifactError(f"no compiled artifact at {artifact_dir}; build it first: {rebuild}")
    try:
        raw = json.loads(path.read_bytes())
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be read ({e.strerror}); fix its permissions or rebuild: {rebuild}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ArtifactError(f"{path} is corrupt (not JSON); rebuild: {rebuild}") from None
    if not isinstance(raw, dict) or raw.get("kind") != KIND:
        raise ArtifactError(f"{path} is not the manifest of an artifact of this compiler; rebuild: {rebuild}")
    if raw.get("format") != FORMAT:
        raise ArtifactError(f"{artifact_dir} was built by another version of this compiler (artifact format "
                            f"{raw.get('format')!r}, this one reads {FORMAT}); rebuild: {rebuild}")
    try:
        return _parse(Manifest, raw, "manifest")
    except _Malformed as e:
        raise ArtifactError(f"{path} is malformed ({e}); rebuild: {rebuild}") from None


def verify_files(artifact_dir: Path, manifest: Manifest, rebuild: str) -> None:
    """Check each module file against its recorded SHA-256 (a truncated or foreign file is an error, never a crash)."""
    for name, digest in manifest.files.items():
        path = artifact_dir / name
        try:
            ok = file_digest(path) == digest
        except FileNotFoundError:
            raise ArtifactError(f"{path} is missing; the artifact is incomplete, rebuild: {rebuild}") from None
        except OSError as e:
            raise ArtifactError(f"{path}: cannot be read ({e.strerror}); fix its permissions or rebuild: {rebuild}") \
                from None
        if not ok:
            raise ArtifactError(f"{path} is damaged (its checksum does not match the manifest: truncated, edited or "
                                f"replaced); rebuild: {rebuild}")


class _Malformed(Exception):
    """A JSON value that does not have the type the manifest declares."""


def _parse(tp, value: Any, where: str):
    """`value` (decoded JSON) as type `tp`: a dataclass, tuple[X, ...], dict[str, X], X | None, or a scalar."""
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Malformed(f"{where} must be an object")
        hints = typing.get_type_hints(tp)
        known = {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise _Malformed(f"{where} has unknown fields {unknown}")
        kwargs = {}
        for name, f in known.items():
            if name in value:
                kwargs[name] = _parse(hints[name], value[name], f"{where}.{name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Malformed(f"{where} lacks field {name!r}")
        return tp(**kwargs)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _parse(option, value, where)
            except _Malformed:
                continue
        raise _Malformed(f"{where} has the wrong type ({value!r})")
    if origin is tuple:
        if not isinstance(value, list):
            raise _Malformed(f"{where} must be a list")
        return tuple(_parse(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise _Malformed(f"{where} must be an object")
        return {k: _parse(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise _Malformed(f"{where} must be an integer, got {value!r}")
    if tp is str and not isinstance(value, str):
        raise _Malformed(f"{where} must be a string, got {value!r}")
    return value
