"""A compiled model ready to run: its checked artifact (runtime/artifact.py), weights, the paged KV arena, steps.

Every call is a step of the artifact's one execution path: the new tokens of one or more sequences,
their KV in pages of an arena. A single sequence (`new_cache` / `forward`) is a batch of one: its
pages come from an arena the model keeps for such sequences; the batch executor has its own.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import tvm
import tvm_ffi

import models
from ir.contract import ATTENTION_ENTRIES, InputSpec, TargetSpec, build_command, hidden_entry
from ir.errors import RudaError
from ir.graph import PAGED_KV_ROLES, PATCHES, RECURRENT_ROLES, ROWS, TOKENS

from .artifact import TARGETS, OpenedArtifact, last_line, open_artifact
from .cpu import tensor_memory, use_all_cores
from .cuda import load_cuda
from .vision import ImagePrompt, encoder_inputs, pack_images
from .weights import load_params

PAGED_ATTENTION_ENV = "RUDA_PAGED_ATTENTION"


class GenerationError(RudaError):
    """A request the loaded model cannot serve (too long for its buckets, ids out of range)."""

    exit_code = 7


class StepFunctions:
    """An artifact's VM functions, each called with the same buffers every time: a step's arrays are copied into its
    input buffers, and it writes its output into its output buffer. A CUDA artifact captures each function's kernels
    into one CUDA graph at its first call and replays it at later ones, reading and writing those buffers and the
    caller's state tensors: so each owner of state tensors (a batch cache; the model, for the stateless image
    encoder) has functions of its own."""

    def __init__(self, opened: OpenedArtifact, device):
        self._functions, self._device = opened.functions(device), device
        self._outputs = opened.manifest.functions
        self._buffers: dict[str, tuple[list[tvm.runtime.Tensor], tvm.runtime.Tensor]] = {}

    def __call__(self, name: str, args: list, params) -> tvm.runtime.Tensor:
        """Call function `name` with `args` (arrays are copied into its input buffers) and the weights `params`; its
        output buffer, which the next call of `name` overwrites."""
        arrays = [a for a in args if isinstance(a, np.ndarray)]
        if name not in self._buffers:
            out = self._outputs[name]
            self._buffers[name] = ([tvm.runtime.empty(a.shape, str(a.dtype), self._device) for a in arrays],
                                   tvm.runtime.empty(out.shape, out.dtype, self._device))
        inputs, output = self._buffers[name]
        for buffer, array in zip(inputs, arrays):
            buffer.copyfrom(array)
        buffers = iter(inputs)
        self._functions[name](*[next(buffers) if isinstance(a, np.ndarray) else a for a in args], output, params)
        return output

    def buffers(self, name: str) -> tuple[list[tvm.runtime.Tensor], tvm.runtime.Tensor] | None:
        """Function `name`'s input buffers (its arrays are copied into them) and output buffer; None before its first
        call."""
        return self._buffers.get(name)


@dataclass
class BatchCache:
    """Batched-execution state: KV pages of attention layers, recurrent-state slots of linear-attention layers, and
    the step functions that run on them."""

    specs: list[InputSpec]
    tensors: list[tvm.runtime.Tensor]
    attention: str
    """'fused' (paged attention reads the page tables) or 'legacy' (each row's history gathered first)."""
    functions: StepFunctions
    valid: bool = True

    def check(self) -> None:
        """Raise if a failed step has made this cache unusable."""
        if not self.valid:
            raise GenerationError("this cache is unusable after a failed step (its state may be half-written); create "
                                  "a new one: new_cache() for one sequence, new_batch_cache() for a batch")


class _SequenceArena:
    """The arena of the model's single sequences: its device tensors, and which pages and state slots are free."""

    def __init__(self, cache: BatchCache, pages: int, slots: int):
        self.cache = cache
        self.free_pages = list(range(pages - 1, -1, -1))  # taken from the end: page 0 first
        self.free_slots = list(range(slots - 1, -1, -1))

    def release(self, pages: list[int], slot: int | None) -> None:
        """Return a sequence's pages and slot."""
        self.free_pages.extend(reversed(pages))
        pages.clear()
        if slot is not None:
            self.free_slots.append(slot)


class StepRow(NamedTuple):
    """One sequence's part of a step: its new tokens, the position of the first, its page table and state slot, and
    for a sequence with images its ImagePrompt (the image tokens' embeddings and the rotary positions)."""

    token_ids: list[int]
    start: int
    pages: list[int]
    slot: int
    images: ImagePrompt | None = None


class KVCache:
    """One sequence's state in the model's arena: its KV pages (taken as it grows), its recurrent-state slot (for
    models with linear-attention layers), how many tokens it holds and may hold. `release()` (or dropping the
    last reference) gives the pages and the slot back."""

    def __init__(self, arena: _SequenceArena, capacity: int, block: int, slot: int | None):
        self.arena, self.capacity, self.length, self.slot = arena, capacity, 0, slot
        self.pages: list[int] = []
        self.images: ImagePrompt | None = None  # the sequence's images, once its prompt held some
        self._block = block
        self._release = weakref.finalize(self, arena.release, self.pages, slot)

    @property
    def released(self) -> bool:
        """Whether the pages and slot were given back (the cache can no longer be used)."""
        return not self._release.alive

    def release(self) -> None:
        """Give the pages and slot back to the arena now."""
        self._release()

    def reserve(self, tokens: int) -> None:
        """Take pages until the cache holds `tokens` tokens, or raise if the arena has too few free."""
        needed = -(-tokens // self._block) - len(self.pages)
        free = self.arena.free_pages
        if needed > len(free):
            raise GenerationError(f"the KV arena has {len(free)} free pages; this sequence needs {needed} more (other "
                                  "live caches hold the rest): release caches you no longer use (cache.release()), "
                                  "or rebuild with a larger --kv-pages")
        self.pages.extend(free.pop() for _ in range(max(needed, 0)))


# What a step costs beyond its token rows, in rows: about the time it takes to read the weights once over the time
# one row's products take (the machine's product rate per weight byte). On the 2-core Xeon of docs/performance.md
# (bfloat16 weights at ~30 GB/s): float32 products ~270 GFLOP/s, ~9 rows; AMX tiles ~1200, ~40 rows; AVX512-BF16 on
# AMD Zen 5 ~700 at ~35 GB/s, ~20 rows. A GPU's products outrun its memory further still.
STEP_COST_ROWS = {None: 8, "avx512bf16": 20, "amx": 40}  # CPU builds, by where their bf16 products run
GPU_STEP_COST_ROWS = 128


def step_cost_rows(target: TargetSpec) -> int:
    """A step's cost beyond its token rows on this artifact's target, in rows (STEP_COST_ROWS)."""
    return GPU_STEP_COST_ROWS if target.kind == "cuda" else STEP_COST_ROWS[target.bf16_products]


def prefill_chunk(remaining: int, buckets: tuple[int, ...], step_cost: int) -> int:
    """The bucket for the next chunk of `remaining` prompt tokens: the first of the cheapest plan, a step costing its
    bucket's rows (padding included) plus `step_cost` rows; the largest bucket while more than two of it remain.

    With buckets (16, 64, 256) and float32 products (8): 20 tokens run as 16 + 16, 63 as 64, 100 as 64 + 64, 200 as
    64 + 64 + 64 + 16; on AMX tiles (40): 20 as 64 and 200 as 256.
    """
    largest = buckets[-1]
    return largest if remaining > 2 * largest else -_cheapest_plans(tuple(buckets), step_cost)[remaining][2]


@functools.lru_cache(maxsize=16)
def _cheapest_plans(buckets: tuple[int, ...], step_cost: int) -> list[tuple[int, int, int]]:
    """For 0 to twice the largest bucket of tokens: (cost in rows, steps, minus the first bucket) of the cheapest
    plan, on a tie the one of fewer steps, then the one that starts with the larger chunk (padding comes last)."""
    plans = [(0, 0, 0)]
    for remaining in range(1, 2 * buckets[-1] + 1):
        rests = [plans[max(remaining - b, 0)] for b in buckets]
        plans.append(min((b + step_cost + cost, steps + 1, -b) for b, (cost, steps, _) in zip(buckets, rests)))
    return plans


class CompiledModel:
    """A model directory's weights bound to its prebuilt artifact."""

    def __init__(self, model_dir: str | Path, artifact: str | Path | None = None, device: str = "cpu"):
        start = time.perf_counter()
        if not isinstance(device, str) or device not in TARGETS:
            raise GenerationError(f"device {device!r} is not supported; valid: {', '.join(TARGETS)}")
        self.target = TARGETS[device]
        if device == "cpu":
            use_all_cores()  # before the first parallel kernel starts TVM's thread pool
        else:
            load_cuda()  # the driver, CUDA runtime and TVM's CUDA loader, or an error naming what is missing
        self.device = tvm.cpu() if device == "cpu" else tvm.cuda(0)
        self.model_dir = Path(model_dir)
        raw, self.config, entries, dtypes = models.load_checkpoint(model_dir)
        opened = open_artifact(self.model_dir, artifact, self.target, self.device, (raw, self.config, dtypes))
        self.artifact, self.manifest, self._opened = opened.path, opened.manifest, opened
        self._encoder = StepFunctions(opened, self.device) if self.vision is not None else None
        self._params = tvm_ffi.Array(load_params(entries, self.manifest.params, self.device))
        self.buckets = self.manifest.buckets
        self._arena: _SequenceArena | None = None  # made at the first new_cache()
        self.load_seconds = time.perf_counter() - start

    @property
    def max_context(self) -> int:
        """The most tokens (prompt + generated) one sequence can hold."""
        return self.buckets.max_context

    def check_request(self, prompt_tokens: int, max_new_tokens: int, where: str = "the request") -> None:
        """Refuse a request whose prompt and new tokens cannot fit one sequence's context."""
        if prompt_tokens + max_new_tokens > self.max_context:
            raise GenerationError(f"{where}: {prompt_tokens} prompt tokens + {max_new_tokens} new tokens exceed the "
                                  f"artifact's --max-context {self.max_context}; shorten the prompt, ask for fewer new "
                                  "tokens, or rebuild with a larger --max-context (up to max_position_embeddings "
                                  f"{self.config.max_position_embeddings})")

    def new_cache(self, tokens: int | None = None) -> KVCache:
        """An empty sequence that may hold up to `tokens` tokens (default: the artifact's --max-context); its pages
        are taken from the model's arena as it grows."""
        tokens = self.max_context if tokens is None else tokens
        if tokens > self.max_context:
            raise GenerationError(f"{tokens} tokens exceed the artifact's --max-context {self.max_context}; shorten "
                                  "the request or rebuild with a larger --max-context (up to max_position_embeddings "
                                  f"{self.config.max_position_embeddings})")
        if self._arena is None or not self._arena.cache.valid:
            self._arena = _SequenceArena(self.new_batch_cache(), self.buckets.kv_pages, self.buckets.batch_rows[-1])
        slot = None
        if self.has_recurrent_state:
            if not self._arena.free_slots:
                raise GenerationError(f"all {self.buckets.batch_rows[-1]} recurrent-state slots are held by live "
                                      "caches: release one (cache.release()) or rebuild with a larger --batch-rows")
            slot = self._arena.free_slots.pop()
        return KVCache(self._arena, tokens, self.buckets.kv_block, slot)

    def _states(self, entry: str) -> list[InputSpec]:
        """The state inputs of an entry (caches, pages, recurrent states), in call order."""
        return [spec for spec in self.manifest.inputs[entry] if spec.is_state]

    def _call(self, functions: StepFunctions, function: str, entry: str, values: dict,
              states: list) -> tvm.runtime.Tensor:
        """Run a VM function of `entry` with its non-state inputs taken by role from `values` and its state tensors in
        order."""
        state = iter(states)
        args = [next(state) if spec.is_state else values[spec.role] for spec in self.manifest.inputs[entry]]
        return functions(function, args, self._params)

    def forward(self, token_ids: list[int], cache: KVCache, images: ImagePrompt | None = None) -> np.ndarray:
        """Append tokens to the sequence in `cache`; the logits after the last one (float32, vocab). The tokens run
        as steps of one row: chunks of the prefill buckets, or a single token. `images`: the prompt with its images
        (runtime.vision.image_prompt; `token_ids` are then its expanded ids), kept with the cache for the tokens
        after it."""
        if not token_ids:
            raise GenerationError("no tokens to run; the prompt encodes to an empty sequence")
        if cache.released:
            raise GenerationError("this cache was released; create a new one with new_cache()")
        if cache.length + len(token_ids) > cache.capacity:
            raise GenerationError(f"sequence of {cache.length + len(token_ids)} tokens exceeds its cache's capacity "
                                  f"{cache.capacity}; create the cache for the whole request")
        self._check_token_ids(token_ids)
        cache.arena.cache.check()
        if images is not None:
            if cache.length:
                raise GenerationError("images come with a sequence's prompt: pass them on the first forward() of a "
                                      "new cache")
            cache.images = images
        cache.reserve(cache.length + len(token_ids))
        done, logits = 0, None
        while done < len(token_ids):
            part = token_ids[done:done + self._chunk(len(token_ids) - done)]
            row = StepRow(part, cache.length, cache.pages, cache.slot or 0, cache.images)
            done += len(part)
            logits = self.step([row], cache.arena.cache, logits=done == len(token_ids))
            cache.length += len(part)
        return logits[0]

    def _check_token_ids(self, token_ids) -> None:
        """Refuse token ids outside the vocabulary (before anything is run or written)."""
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise GenerationError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.config.vocab_size - 1})")

    def _chunk(self, remaining: int) -> int:
        """Tokens of the next step of one sequence (see prefill_chunk; a single token is a step of its own)."""
        return prefill_chunk(remaining, self.buckets.step_tokens, step_cost_rows(self.manifest.target))

    def forward_cached_last(self, token_ids: list[int], cache: KVCache) -> np.ndarray:
        """The logits after the last of `token_ids`, appended to `cache` (pass only tokens not yet in it)."""
        return self.forward(token_ids, cache)

    def new_batch_cache(self) -> "BatchCache":
        """The state of steps: KV pages of every attention layer (all pages reserved now) and the recurrent-state
        slots of linear-attention layers. Its attention path comes from RUDA_PAGED_ATTENTION now."""
        b = self.buckets
        choice = os.environ.get(PAGED_ATTENTION_ENV) or "fused"
        if choice not in ATTENTION_ENTRIES:
            raise GenerationError(f"{PAGED_ATTENTION_ENV}={choice!r} is not valid; use 'fused' (paged attention over "
                                  "the KV arena) or 'legacy' (history gathered first), or leave it unset (fused)")
        if ATTENTION_ENTRIES[choice] not in b.entries:
            options = self.manifest.build_options + ("--legacy-paged-attention",)
            raise GenerationError(f"{PAGED_ATTENTION_ENV}=legacy: {self.artifact} has no legacy attention path; "
                                  f"rebuild with --legacy-paged-attention: "
                                  f"{build_command(self.model_dir, self.target, self.artifact, options)}")
        specs = self._states("step")
        memory = tensor_memory(self.device)  # KV pages and states, read every step
        return BatchCache(specs, [memory.empty(tuple(s.shape), s.dtype) for s in specs], choice,
                          StepFunctions(self._opened, self.device))

    @property
    def has_recurrent_state(self) -> bool:
        """Whether a sequence's state is more than its KV pages (recurrent layers: conv and recurrent states)."""
        return any(spec.role in RECURRENT_ROLES for spec in self.manifest.inputs.get("step", ()))

    def copy_page(self, cache: "BatchCache", src: int, dst: int) -> None:
        """Copy one KV page of every attention layer (copy-on-write of a shared prefix page), on the device."""
        cache.check()
        for spec, tensor in zip(cache.specs, cache.tensors):
            if spec.role in PAGED_KV_ROLES:
                page_shape = tuple(tensor.shape[1:])
                page_bytes = int(np.prod(page_shape)) * np.dtype(tensor.dtype).itemsize
                views = [tensor._create_view(page_shape, tensor.dtype, relative_byte_offset=p * page_bytes)
                         for p in (src, dst)]
                views[0].copyto(views[1])

    def step(self, rows: list[StepRow], cache: "BatchCache", logits: bool = True) -> np.ndarray | None:
        """Run one step of these rows (StepRow, or a plain (token ids, start, pages, slot) tuple); logits after each
        row's last token, or None with `logits=False` (no row's next token is wanted: the step skips the vocabulary
        head). A failed step leaves the cache unusable."""
        cache.check()
        rows = [StepRow(*row) for row in rows]
        b = self.buckets
        block, width = b.kv_block, b.pages_per_row
        total = sum(len(row.token_ids) for row in rows)
        row_bucket = next((r for r in b.batch_rows if r >= len(rows)), None)
        tokens = next((t for t in b.step_tokens if t >= max(total, row_bucket or 0)), None)
        if tokens is None or row_bucket is None:
            raise GenerationError(f"a batch of {len(rows)} sequences and {total} tokens exceeds the built batch steps "
                                  f"(rows {list(b.batch_rows)}, tokens {list(b.step_tokens)})")
        self._check_token_ids([t for row in rows for t in row.token_ids])
        bad_slot = [row.slot for row in rows if not 0 <= row.slot < b.batch_rows[-1]]
        if bad_slot:
            raise GenerationError(f"state slots {bad_slot} are outside 0..{b.batch_rows[-1] - 1}")
        ids, pos_of, row_of = (np.zeros(tokens, np.int32) for _ in range(3))
        slots = np.full(tokens, -1, np.int32)
        table = np.full((row_bucket, width), -1, np.int32)
        last, seq_start, seq_len, seq_pos = (np.zeros(row_bucket, np.int32) for _ in range(4))
        seq_slot = np.full(row_bucket, -1, np.int32)
        at = 0
        for r, (new, start, pages, slot, _) in enumerate(rows):
            positions = np.arange(start, start + len(new))
            page_ids = np.asarray(pages, np.int32)
            ids[at:at + len(new)], pos_of[at:at + len(new)], row_of[at:at + len(new)] = new, positions, r
            slots[at:at + len(new)] = page_ids[positions // block] * block + positions % block
            table[r, :len(pages)] = page_ids
            seq_start[r], seq_len[r], seq_pos[r], seq_slot[r] = at, len(new), start, slot
            at += len(new)
            last[r] = at - 1
        values = {"token_ids": ids, "token_positions": pos_of, "token_rows": row_of, "kv_slots": slots,
                  "block_table": table, "last_tokens": last, "token_count": np.array([total], np.int32),
                  "seq_start": seq_start, "seq_len": seq_len, "seq_pos": seq_pos, "seq_slot": seq_slot}
        if self.vision is not None:
            values |= self._multimodal_values(rows, pos_of)
        entry = ATTENTION_ENTRIES[cache.attention]
        entry = entry if logits else hidden_entry(entry)
        try:
            out = self._call(cache.functions, b.function_name(entry, {TOKENS: tokens, ROWS: row_bucket}), entry,
                             values, cache.tensors)
        except Exception as e:
            cache.valid = False
            raise GenerationError(f"the step failed ({last_line(e)}); its KV pages and states may be half-written, "
                                  "so this cache can no longer be used: create a new one (new_cache() for one "
                                  "sequence, new_batch_cache() for a batch)") from e
        return out.numpy()[:len(rows)] if logits else None

    def _multimodal_values(self, rows: list[StepRow], pos_of: np.ndarray) -> dict[str, np.ndarray]:
        """The image inputs of a step: image tokens' embeddings and mask, and every token's rotary position (its
        position in `pos_of` on all three axes, a prompt with images' own positions for its rows)."""
        embeds = np.zeros((len(pos_of), self.config.hidden_size), np.float32)
        mask = np.zeros(len(pos_of), np.int32)
        positions = np.repeat(pos_of[:, None], 3, axis=1)
        at = 0
        for row in rows:
            n = len(row.token_ids)
            if row.images is not None:
                positions[at:at + n] = row.images.rope_positions(row.start, n)
                image_rows = row.images.rows(row.start, n)
                is_image = image_rows >= 0
                mask[at:at + n] = is_image
                embeds[at:at + n][is_image] = row.images.embeddings[image_rows[is_image]]
            at += n
        return {"input_embeddings": embeds, "embedding_mask": mask, "rope_positions": positions}

    @property
    def vision(self):
        """The vision encoder's config (models.qwen3_5_vision.VisionConfig), or None for a text-only model."""
        return getattr(self.config, "vision", None)

    def encode_images(self, pixels: np.ndarray, grids: list[tuple[int, int, int]]) -> list[np.ndarray]:
        """Each image's embeddings [its tokens, hidden] from its preprocessed patches (`pixels`: every image's patches
        in order, [patches, patch values]; `grids`: each image's (t, h, w)). Images share encoder calls while they
        fit the largest patch bucket."""
        if self.vision is None:
            raise GenerationError(f"{self.model_dir} has no vision encoder (config.json declares no vision_config): "
                                  "it takes text only")
        buckets = self.buckets.image_patches
        counts = [int(np.prod(g)) for g in grids]
        too_big = [(i, n) for i, n in enumerate(counts) if n > buckets[-1]]
        if too_big:
            i, n = too_big[0]
            raise GenerationError(f"image {i + 1} has {n} patches, more than the largest image bucket "
                                  f"({buckets[-1]} patches): rebuild with a larger --image-patch-buckets "
                                  f"(e.g. {','.join(map(str, buckets[:-1] + (n,)))}), or lower max_pixels in "
                                  "preprocessor_config.json")
        starts = np.cumsum([0] + counts)
        out: list[np.ndarray] = []
        for call in pack_images(counts, buckets[-1]):
            first, end = int(starts[call[0]]), int(starts[call[-1] + 1])
            bucket = next(b for b in buckets if b >= end - first)
            values = encoder_inputs(pixels[first:end], [grids[i] for i in call], self.vision, bucket)
            merged = self._call(self._encoder, self.buckets.function_name("encode_image", {PATCHES: bucket}),
                                "encode_image", values, []).numpy()
            tokens = np.cumsum([0] + [counts[i] // self.vision.merge_unit for i in call])
            out += [merged[tokens[k]:tokens[k + 1]] for k in range(len(call))]
        return out
