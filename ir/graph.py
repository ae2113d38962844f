"""The typed dataflow graph: tensor types, params, ops, entry graphs and the program."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from .packing import Packing

Dim = Union[int, str]
"""A dimension: a fixed size, or the name of a symbolic dim bound per shape bucket."""

DTYPES = ("float32", "float16", "bfloat16", "int32")

# Symbolic dims the compiler binds per shape bucket.
TOKENS = "tokens"  # token rows of one step (every new token of every sequence in it, padded)
ROWS = "rows"  # sequences in one batch step
PAGES = "pages"  # pages in the shared KV arena of batched execution
BLOCK = "block"  # tokens per KV page
PAGES_PER_ROW = "pages_per_row"  # block-table width: pages one sequence may hold
HISTORY = "history"  # positions a block table covers: pages_per_row * block
SLOTS = "slots"  # recurrent-state slots of batched execution: one per sequence a batch may hold
PATCHES = "patches"  # image patch rows of one image-encoder call (every patch of every image in it, padded)
IMAGE_TOKENS = "image_tokens"  # the encoder's output rows: its patches merged (a dim derived from PATCHES)

# Bucket axes: the symbolic dims an entry declares to be specialised per VM function (each over the sizes the
# build options give, ir.contract.Buckets.sizes), with the tag that names a size in a function name
# (step_t16_r1). Every other symbolic dim is bound once per artifact (the KV arena's).
BUCKET_AXES = {TOKENS: "t", ROWS: "r", PATCHES: "p"}
AXIS_LIMITS = {ROWS: TOKENS}  # a size of the key's axis is at most the value's: a step holds a token per row


# What each runtime input of an entry carries: the runtime fills inputs by role, never by name or position.
INPUT_ROLES = {
    "token_ids": "the new tokens, one per row (padded to the bucket)",
    "input_embeddings": "input embeddings of the new tokens, one row each, used where embedding_mask is set",
    "embedding_mask": "per token: 1 takes its row of input_embeddings (an image token), 0 embeds its token id",
    "rope_positions": "each token's multimodal rotary position (temporal, height, width)",
    "token_count": "how many of the tokens are real",
    "token_positions": "each token's position in its sequence",
    "token_rows": "each token's sequence (its row of the block table)",
    "kv_slots": "each token's KV slot (page * block + offset; negative for padding)",
    "block_table": "the pages of each sequence",
    "last_tokens": "each sequence's last token row (whose logits come out)",
    "seq_start": "each sequence's first token row",
    "seq_len": "each sequence's token count",
    "seq_pos": "each sequence's first position",
    "seq_slot": "each sequence's recurrent-state slot",
    "image_patches": "the images' patches, flattened pixels, one row each (images after each other, padded)",
    "patch_positions": "each patch's (row, column) in its image's patch grid",
    "patch_images": "each patch's image: attention stays within an image",
    "patch_interpolation_index": "each patch's position-embedding table rows to interpolate",
    "patch_interpolation_weight": "the weights of those rows",
    "k_pages": "state of one layer: the KV arena's key pages",
    "v_pages": "state of one layer: the KV arena's value pages",
    "conv_pool": "state of one layer: causal-conv windows, one per slot",
    "recurrent_pool": "state of one layer: recurrent states, one per slot",
}
STATE_ROLES = frozenset(role for role, what in INPUT_ROLES.items() if what.startswith("state of one layer"))
PAGED_KV_ROLES = ("k_pages", "v_pages")
RECURRENT_ROLES = ("conv_pool", "recurrent_pool")


@dataclass(frozen=True)
class Role:
    """What a graph input carries: a kind from INPUT_ROLES and, for state, its layer."""

    kind: str
    layer: int | None = None

    @property
    def is_state(self) -> bool:
        """Whether the input is state a call reads and updates (caches, pages, recurrent states)."""
        return self.kind in STATE_ROLES


@dataclass(frozen=True)
class TensorType:
    """Shape (ints or symbolic dim names) and element dtype of a value; a packed weight (quantised) also says its
    packing, and is stored as the packing's parts."""

    shape: tuple[Dim, ...]
    dtype: str
    packing: Packing | None = None

    def __str__(self) -> str:
        packed = f"{self.packing}:" if self.packing else ""
        return f"{packed}{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    def bind(self, dims: dict[str, int]) -> "TensorType":
        """This type with its symbolic dims replaced by the sizes in `dims`."""
        return TensorType(tuple(dims.get(d, d) if isinstance(d, str) else d for d in self.shape), self.dtype,
                          self.packing)

    def parts(self) -> tuple["TensorType", ...]:
        """The tensors a value of this type is stored and passed to kernels as: itself, or its packing's parts."""
        if self.packing is None:
            return (self,)
        return tuple(TensorType(shape, dtype) for shape, dtype in self.packing.parts(self.shape, self.dtype))


# How a param is made from its checkpoint tensors (the weight map); the runtime's loader implements each.
WEIGHT_TRANSFORMS = {
    "copy": "the one source tensor as the checkpoint stores it",
    "flatten": "the one source tensor with its trailing dims flattened into one (a patch conv kernel as a matrix)",
    "awq_tiles": "AWQ qweight, qzeros (or offsets), scales as stored, qweight regrouped into column tiles "
                 "(ir.packing)",
    "awq_pairs": "AWQ qweight and qzeros regrouped into words of two rows of four columns, scales reordered to "
                 "match (ir.packing)",
    "affine_pairs": "qweight regrouped as awq_pairs does, offsets and scales both reordered as its scales "
                    "(ir.packing affine_int4_pairs)",
}


@dataclass(frozen=True)
class Param:
    """A weight: its name and type, and the weight map's entry for it: the checkpoint tensors it is made from
    (none given: the one of its own name) and the transform (WEIGHT_TRANSFORMS) that makes it. A storage type
    (quantised, blocked) plugs in here, with its own params and transform, not in the model builders."""

    name: str
    type: TensorType
    sources: tuple[str, ...] = ()
    transform: str = "copy"

    @property
    def source_tensors(self) -> tuple[str, ...]:
        """The checkpoint tensors this param is made from."""
        return self.sources or (self.name,)


@dataclass(frozen=True)
class Op:
    """One operation: a kind from `ir.ops`, input and output value names, and attributes."""

    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Graph:
    """One entry point (a step, an image encoder): runtime inputs and their roles, ops in order, outputs, value
    types; the bucket axes (BUCKET_AXES) it is compiled over, one VM function per combination of their sizes, and
    the dims derived from them (name -> (axis, divisor): the axis' size divided by the divisor); and whether it is
    optional (built only when the build asks for it, e.g. the legacy attention path)."""

    name: str
    inputs: list[str]
    ops: list[Op]
    outputs: list[str]
    types: dict[str, TensorType]
    roles: dict[str, Role] = field(default_factory=dict)
    bucket_dims: tuple[str, ...] = ()
    optional: bool = False
    derived_dims: dict[str, tuple[str, int]] = field(default_factory=dict)

    def bind_derived(self, sizes: dict[str, int]) -> dict[str, int]:
        """The derived dims' sizes for these bucket-axis sizes."""
        return {dim: sizes[axis] // divisor for dim, (axis, divisor) in self.derived_dims.items()}


@dataclass
class Program:
    """A whole model: its params (shared by all entries) and its entry graphs."""

    model_type: str
    params: dict[str, Param]
    entries: dict[str, Graph]
    meta: dict[str, Any] = field(default_factory=dict)

    def param_types(self) -> dict[str, TensorType]:
        """Param name -> type."""
        return {name: p.type for name, p in self.params.items()}
