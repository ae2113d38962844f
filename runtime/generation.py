"""Greedy generation over a compiled model with a KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ir.errors import RudaError

from .engine import CompiledModel


@dataclass
class GreedyResult:
    """Token ids of one greedy generation and how long its phases took."""

    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    stopped_on_eos: bool
    prefill_seconds: float
    decode_seconds: float


def generate_greedy(model: CompiledModel, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_ids: list[int]) -> GreedyResult:
    """One prefill over the prompt, then one decode step per new token (fed only that token)."""
    if max_new_tokens < 1:
        raise RudaError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache = model.new_cache(len(prompt_ids) + max_new_tokens)
    start = time.perf_counter()
    token = int(np.argmax(model.forward(prompt_ids, cache)))
    prefill_done = time.perf_counter()
    generated = [token]
    eos = set(eos_token_ids)
    while token not in eos and len(generated) < max_new_tokens:
        token = int(np.argmax(model.forward([token], cache)))
        generated.append(token)
    end = time.perf_counter()
    return GreedyResult(list(prompt_ids), generated, token in eos, prefill_done - start, end - prefill_done)
