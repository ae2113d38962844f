"""A compiled model ready to run: artifact checks, weights, KV caches, prefill and decode steps."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine

import models
from ir import CONTEXT
from ir.contract import (
    MODEL_PACKAGES,
    MODULE,
    ArtifactError,
    Buckets,
    InputSpec,
    build_command,
    config_hash,
    default_artifact_dir,
    read_manifest,
    source_hash,
    verify_files,
)
from ir.cpu_features import missing_host_features
from ir.graph import PAGED_KV_ROLES, RECURRENT_ROLES
from ir.errors import RudaError
from .cpu import enable_amx, use_all_cores
from .weights import load_params

TARGETS = {"cpu": "llvm", "cuda": "cuda"}
PAGED_ATTENTION_ENV = "RUDA_PAGED_ATTENTION"
ATTENTION_PATHS = {"fused": "step", "legacy": "gather"}  # RUDA_PAGED_ATTENTION -> batched step functions


class GenerationError(RudaError):
    """A request the loaded model cannot serve (too long for its buckets, ids out of range)."""

    exit_code = 7


@dataclass
class BatchCache:
    """Batched-execution state: KV pages of attention layers, recurrent-state slots of linear-attention layers."""

    specs: list[InputSpec]
    tensors: list[tvm.runtime.Tensor]
    attention: str
    """'fused' (paged attention reads the page tables) or 'legacy' (each row's history gathered first)."""
    valid: bool = True

    def check(self) -> None:
        """Raise if a failed step has made this cache unusable."""
        if not self.valid:
            raise GenerationError("this batch cache is unusable after a failed step (its state may be half-written); "
                                  "create a new one with new_batch_cache()")


@dataclass
class KVCache:
    """One sequence's state for every layer at one capacity bucket: keys and values of attention
    layers, and the (zero-initialised) conv and recurrent states of linear-attention layers."""

    tensors: list[tvm.runtime.Tensor]
    capacity: int
    length: int = 0


def _without(options: tuple[str, ...], *flags: str) -> tuple[str, ...]:
    """Build options with these flags (and their values) left out."""
    out, skip = [], False
    for option in options:
        if skip:
            skip = False
        elif option in flags:
            skip = True
        else:
            out.append(option)
    return tuple(out)


def _last_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def prefill_chunk(remaining: int, buckets: list[int]) -> int:
    """The bucket for the next prefill chunk: the largest that is filled, else the smallest that holds the rest.

    Padding is wasted work, so 100 tokens with buckets (16, 64, 256) run as 64 + 64, not one 256.
    """
    filled = [b for b in buckets if b <= remaining]
    return filled[-1] if filled else next(b for b in buckets if b >= remaining)


class CompiledModel:
    """A model directory's weights bound to its prebuilt artifact."""

    def __init__(self, model_dir: str | Path, artifact: str | Path | None = None, device: str = "cpu"):
        start = time.perf_counter()
        if not isinstance(device, str) or device not in TARGETS:
            raise GenerationError(f"device {device!r} is not supported; valid: {', '.join(TARGETS)}")
        self.target = TARGETS[device]
        self.device = tvm.cpu() if device == "cpu" else tvm.cuda(0)
        if not self.device.exist:
            raise GenerationError("--device cuda: no CUDA GPU is visible on this machine; run on a machine with an "
                                  "NVIDIA GPU and driver, or use --device cpu")
        if device == "cpu":
            use_all_cores()  # before the first parallel kernel starts TVM's thread pool
        self.model_dir = Path(model_dir)
        raw, self.config, entries, dtypes = models.load_checkpoint(model_dir)
        if artifact is not None and not isinstance(artifact, (str, os.PathLike)):
            raise ArtifactError(f"artifact must be a path, got {type(artifact).__name__}")
        self.artifact = Path(artifact) if artifact is not None else default_artifact_dir(model_dir, self.target)
        self.manifest = read_manifest(self.artifact, build_command(model_dir, self.target, artifact))
        self._check_target(artifact)
        rebuild = build_command(model_dir, self.target, artifact, self.manifest.build_options)
        self._check_manifest(raw, dtypes, rebuild)
        verify_files(self.artifact, self.manifest, rebuild)
        try:
            self._vm = VirtualMachine(tvm.runtime.load_module(str(self.artifact / MODULE)), self.device)
            self._functions = {name: self._vm[name] for name in self.manifest.functions}
        except Exception as e:  # TVM raises bare errors for a module it cannot load
            raise ArtifactError(f"{self.artifact / MODULE} cannot be loaded ({_last_line(e)}); rebuild: {rebuild}") \
                from None
        self._params = tvm_ffi.Array(load_params(entries, self.manifest.params, self.device))
        self.prefill_buckets = self.manifest.buckets.prefill_tokens
        self.context_buckets = self.manifest.buckets.context
        self.load_seconds = time.perf_counter() - start

    def _check_target(self, artifact) -> None:
        """The artifact must be for this device; else say which device runs it and how to build for this one."""
        kind = self.manifest.target.kind
        if kind == self.target:
            return
        device = next(d for d, t in TARGETS.items() if t == kind)
        raise ArtifactError(f"{self.artifact} was built for --target {kind}: run it with --device {device}, or build "
                            f"one for this device: {build_command(self.model_dir, self.target, artifact)}")

    def _check_manifest(self, raw_config: dict, dtypes: dict[str, str], rebuild: str) -> None:
        m = self.manifest
        if m.model_type != self.config.model_type or m.config_hash != config_hash(raw_config):
            raise ArtifactError(f"{self.artifact} was built for another model or config.json "
                                f"(built from {m.built_from}); rebuild: {rebuild}")
        if m.tvm_version != tvm.__version__:
            raise ArtifactError(f"{self.artifact} was built with TVM {m.tvm_version}, this is TVM {tvm.__version__}; "
                                f"rebuild: {rebuild}")
        if m.model_code_hash != source_hash(MODEL_PACKAGES):
            raise ArtifactError(f"{self.artifact} was built by another version of the model code (ir/, models/); "
                                f"rebuild: {rebuild}")
        changed = [f"{name} is {dtypes.get(name)} here, {dtype} in the artifact" for p in m.params
                   for name, dtype in zip(p.sources, p.source_dtypes) if dtypes.get(name) != dtype]
        if changed:
            raise ArtifactError(f"{self.artifact} was built for other weights ({changed[0]}); rebuild: {rebuild}")
        if self.target == "cuda":
            arch = int(m.target.arch.removeprefix("sm_"))
            here = int(self.device.compute_version.replace(".", ""))
            if arch > here:
                rebuild_here = build_command(self.model_dir, self.target, self.artifact,
                                             _without(m.build_options, "--arch") + ("--arch", f"sm_{here}"))
                raise ArtifactError(f"{self.artifact} holds PTX for {m.target.arch}, which this GPU (sm_{here}) "
                                    f"cannot run; rebuild: {rebuild_here}")
        missing = missing_host_features(list(m.target.features))
        if missing:
            rebuild_here = build_command(self.model_dir, self.target, self.artifact,
                                         _without(m.build_options, "--mcpu", "--matmul-precision"))
            raise ArtifactError(f"{self.artifact} was compiled for CPU {m.target.mcpu!r}, which uses {missing} "
                                f"that this machine lacks; rebuild here: {rebuild_here}")
        if "amx-tile" in m.target.features:
            try:
                enable_amx()
            except OSError as e:
                rebuild_plain = build_command(self.model_dir, self.target, self.artifact,
                                              _without(m.build_options, "--matmul-precision"))
                raise ArtifactError(f"{self.artifact} runs its prefill products on AMX tiles, but {e.strerror}; "
                                    f"rebuild without them: {rebuild_plain}") from None

    @property
    def max_context(self) -> int:
        """The most tokens (prompt + generated) one sequence can hold."""
        return self.context_buckets[-1]

    def check_request(self, prompt_tokens: int, max_new_tokens: int, where: str = "the request") -> None:
        """Refuse a request whose prompt and new tokens cannot fit one sequence's context."""
        if prompt_tokens + max_new_tokens > self.max_context:
            raise GenerationError(f"{where}: {prompt_tokens} prompt tokens + {max_new_tokens} new tokens exceed the "
                                  f"largest context bucket {self.max_context}; shorten the prompt, ask for fewer new "
                                  "tokens, or rebuild with a larger --context-buckets (up to max_position_embeddings "
                                  f"{self.config.max_position_embeddings})")

    def new_cache(self, tokens: int | None = None) -> KVCache:
        """An empty cache of the smallest capacity bucket that holds `tokens` tokens (default: the largest)."""
        tokens = self.max_context if tokens is None else tokens
        fitting = [c for c in self.context_buckets if c >= tokens]
        if not fitting:
            raise GenerationError(f"{tokens} tokens exceed the largest context bucket {self.max_context}; shorten "
                                  "the request or rebuild with a larger --context-buckets (up to "
                                  f"max_position_embeddings {self.config.max_position_embeddings})")
        tensors = []
        for spec in self._states("decode"):
            shape = tuple(fitting[0] if d == CONTEXT else d for d in spec.shape)
            if spec.role in RECURRENT_ROLES:  # recurrent state starts at zero
                tensors.append(tvm.runtime.tensor(np.zeros(shape, spec.dtype), self.device))
            else:  # KV rows are written before they are read
                tensors.append(tvm.runtime.empty(shape, spec.dtype, self.device))
        return KVCache(tensors, fitting[0])

    def _states(self, entry: str) -> list[InputSpec]:
        """The state inputs of an entry (caches, pages, recurrent states), in call order."""
        return [spec for spec in self.manifest.inputs[entry] if spec.is_state]

    def _call(self, function: str, entry: str, values: dict, states: list) -> tvm.runtime.Tensor:
        """Run a VM function of `entry` with its non-state inputs taken by role from `values` (arrays become device
        tensors) and its state tensors in order."""
        state = iter(states)
        args = [next(state) if spec.is_state else values[spec.role] for spec in self.manifest.inputs[entry]]
        args = [tvm.runtime.tensor(a, self.device) if isinstance(a, np.ndarray) else a for a in args]
        return self._functions[function](*args, self._params)

    def forward(self, token_ids: list[int], cache: KVCache) -> np.ndarray:
        """Append tokens to the sequence in `cache`; the logits after the last one (float32, vocab)."""
        if not token_ids:
            raise GenerationError("no tokens to run; the prompt encodes to an empty sequence")
        if cache.length + len(token_ids) > cache.capacity:
            raise GenerationError(f"sequence of {cache.length + len(token_ids)} tokens exceeds its KV cache capacity "
                                  f"{cache.capacity}; create the cache for the whole request")
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise GenerationError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.config.vocab_size - 1})")
        if len(token_ids) == 1:
            return self._run("decode", f"decode_c{cache.capacity}", token_ids, 1, cache)
        done, logits = 0, None
        while done < len(token_ids):
            rest = len(token_ids) - done
            chunk = prefill_chunk(rest, [t for t in self.prefill_buckets if t <= cache.capacity])
            part = token_ids[done:done + chunk]
            logits = self._run("prefill", f"prefill_t{chunk}_c{cache.capacity}", part, chunk, cache)
            done += len(part)
        return logits

    def forward_cached_last(self, token_ids: list[int], cache: KVCache) -> np.ndarray:
        """The logits after the last of `token_ids`, appended to `cache` (pass only tokens not yet in it)."""
        return self.forward(token_ids, cache)

    def batch_layout(self) -> Buckets:
        """The artifact's batched-step buckets and KV arena layout, or an error saying how to build them."""
        b = self.manifest.buckets
        if not b.batch_rows:
            options = self.manifest.build_options + ("--batch-rows", "1,4,16")
            raise GenerationError(f"{self.artifact} has no batched steps; rebuild with --batch-rows: "
                                  f"{build_command(self.model_dir, self.target, self.artifact, options)}")
        return b

    def new_batch_cache(self) -> "BatchCache":
        """The state of batched execution: KV pages of every attention layer (all pages reserved now) and the
        recurrent-state slots of linear-attention layers. Its attention path comes from RUDA_PAGED_ATTENTION now."""
        b = self.batch_layout()
        choice = os.environ.get(PAGED_ATTENTION_ENV) or "fused"
        if choice not in ATTENTION_PATHS:
            raise GenerationError(f"{PAGED_ATTENTION_ENV}={choice!r} is not valid; use 'fused' (paged attention over "
                                  "the KV arena) or 'legacy' (history gathered first), or leave it unset (fused)")
        if choice == "legacy" and not b.legacy_attention:
            options = self.manifest.build_options + ("--legacy-paged-attention",)
            raise GenerationError(f"{PAGED_ATTENTION_ENV}=legacy: {self.artifact} has no legacy attention path; "
                                  f"rebuild with --legacy-paged-attention: "
                                  f"{build_command(self.model_dir, self.target, self.artifact, options)}")
        specs = self._states("step")
        return BatchCache(specs, [tvm.runtime.empty(tuple(s.shape), s.dtype, self.device) for s in specs], choice)

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

    def step(self, rows: list[tuple[list[int], int, list[int], int]], cache: "BatchCache") -> np.ndarray:
        """Run one batch: each row is (new token ids, start position, page table, state slot); logits after each
        row's last token. A failed step leaves the cache unusable."""
        cache.check()
        b = self.manifest.buckets
        block, width = b.kv_block, b.pages_per_row
        total = sum(len(ids) for ids, *_ in rows)
        row_bucket = next((r for r in b.batch_rows if r >= len(rows)), None)
        tokens = next((t for t in b.step_tokens if t >= max(total, row_bucket or 0)), None)
        if tokens is None or row_bucket is None:
            raise GenerationError(f"a batch of {len(rows)} sequences and {total} tokens exceeds the built batch steps "
                                  f"(rows {list(b.batch_rows)}, tokens {list(b.step_tokens)})")
        bad_slot = [slot for *_, slot in rows if not 0 <= slot < b.batch_rows[-1]]
        if bad_slot:
            raise GenerationError(f"state slots {bad_slot} are outside 0..{b.batch_rows[-1] - 1}")
        ids, pos_of, row_of = (np.zeros(tokens, np.int32) for _ in range(3))
        slots = np.full(tokens, -1, np.int32)
        table = np.full((row_bucket, width), -1, np.int32)
        last, seq_start, seq_len, seq_pos = (np.zeros(row_bucket, np.int32) for _ in range(4))
        seq_slot = np.full(row_bucket, -1, np.int32)
        at = 0
        for r, (new, start, pages, slot) in enumerate(rows):
            positions = np.arange(start, start + len(new))
            page_ids = np.asarray(pages, np.int32)
            ids[at:at + len(new)], pos_of[at:at + len(new)], row_of[at:at + len(new)] = new, positions, r
            slots[at:at + len(new)] = page_ids[positions // block] * block + positions % block
            table[r, :len(pages)] = page_ids
            seq_start[r], seq_len[r], seq_pos[r], seq_slot[r] = at, len(new), start, slot
            at += len(new)
            last[r] = at - 1
        if (ids >= self.config.vocab_size).any() or (ids < 0).any():
            raise GenerationError(f"token ids are outside the vocabulary (0..{self.config.vocab_size - 1})")
        values = {"token_ids": ids, "token_positions": pos_of, "token_rows": row_of, "kv_slots": slots,
                  "block_table": table, "last_tokens": last, "token_count": total, "seq_start": seq_start,
                  "seq_len": seq_len, "seq_pos": seq_pos, "seq_slot": seq_slot}
        function = f"{ATTENTION_PATHS[cache.attention]}_t{tokens}_r{row_bucket}"
        try:
            out = self._call(function, "step", values, cache.tensors)
        except Exception as e:
            cache.valid = False
            raise GenerationError(f"the batched step failed ({e}); its KV pages and states may be half-written, so "
                                  "this batch cache can no longer be used: create a new one with new_batch_cache()") from e
        return out.numpy()[:len(rows)]

    def _run(self, entry: str, function: str, ids: list[int], padded: int, cache: KVCache) -> np.ndarray:
        buf = np.zeros(padded, dtype=np.int32)
        buf[:len(ids)] = ids
        values = {"token_ids": buf, "start_position": cache.length, "token_count": len(ids)}
        out = self._call(function, entry, values, cache.tensors)
        cache.length += len(ids)
        return out.numpy()[0]
