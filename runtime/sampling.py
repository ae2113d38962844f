"""Generation settings and next-token choice: greedy, or temperature -> top-k -> top-p -> seeded draw.

Every setting is validated when the config is made, so a bad value fails before any work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ir.errors import RudaError


class GenerationConfigError(RudaError, ValueError):
    """An invalid generation or sampling setting."""

    exit_code = 7


def _fail(name: str, value, rule: str):
    raise GenerationConfigError(f"{name} {rule}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingConfig:
    """Temperature (finite, > 0), top_k (0 = off, boundary ties kept), top_p ((0, 1], 1 = off), seed (None = entropy)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            _fail("temperature", t, "must be finite and > 0 (use greedy generation for the max-logit token)")
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            _fail("top_p", p, "must be in (0, 1] (1 disables it)")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            _fail("seed", self.seed, "must be a non-negative integer or None")


@dataclass(frozen=True)
class GreedyGenerationConfig:
    """Max new tokens (> 0), EOS ids (None = the model's defaults), repetition penalty (1 = off), stop strings."""

    max_new_tokens: int = 32
    eos_token_ids: Sequence[int] | None = None
    repetition_penalty: float = 1.0
    stop_strings: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            _fail("max_new_tokens", self.max_new_tokens, "must be an integer > 0")
        eos = self.eos_token_ids
        if eos is not None:
            if isinstance(eos, (str, bytes)) or not isinstance(eos, Sequence) or not all(_is_int(e) and e >= 0 for e in eos):
                _fail("eos_token_ids", eos, "must be a list of non-negative token ids or None")
            object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in eos))
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            _fail("repetition_penalty", r, "must be finite and > 0 (1 disables it)")
        stops = self.stop_strings
        if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
            _fail("stop_strings", stops, "must be a list of non-empty strings")
        object.__setattr__(self, "stop_strings", tuple(stops))


@dataclass(frozen=True)
class SamplingGenerationConfig(GreedyGenerationConfig):
    """The greedy settings plus how to sample."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.sampling, SamplingConfig):
            _fail("sampling", self.sampling, "must be a SamplingConfig")


def apply_repetition_penalty(logits: np.ndarray, context: Sequence[int], penalty: float) -> np.ndarray:
    """transformers' rule: for tokens already in the context, divide positive logits by penalty, multiply negative ones."""
    if penalty == 1.0 or not len(context):
        return logits
    out = logits.copy()
    seen = np.unique(np.asarray(context, dtype=np.int64))
    picked = out[seen]
    out[seen] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def filtered_distribution(logits: np.ndarray, sampling: SamplingConfig) -> np.ndarray:
    """Probabilities after temperature, then top-k (ties at the boundary kept), then top-p; zeros elsewhere."""
    scaled = logits.astype(np.float64) / sampling.temperature
    keep = np.isfinite(scaled)
    if 0 < sampling.top_k < scaled.size:
        kth = np.partition(scaled, scaled.size - sampling.top_k)[scaled.size - sampling.top_k]
        keep &= scaled >= kth
    probs = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
    probs /= probs.sum()
    if sampling.top_p < 1.0:
        order = np.lexsort((np.arange(probs.size), -probs))  # descending probability, lower id first
        mass_before = np.cumsum(probs[order]) - probs[order]
        dropped = order[mass_before >= sampling.top_p]
        probs[dropped] = 0.0
        probs /= probs.sum()
    return probs


TokenPicker = Callable[[np.ndarray, Sequence[int]], int]


def make_picker(config: GreedyGenerationConfig) -> TokenPicker:
    """The next-token rule of a config: argmax for greedy, a seeded draw for sampling (one generator per request)."""
    penalty = config.repetition_penalty
    if not isinstance(config, SamplingGenerationConfig):
        return lambda logits, context: int(np.argmax(apply_repetition_penalty(logits, context, penalty)))
    sampling = config.sampling
    rng = np.random.default_rng(sampling.seed)

    def draw(logits: np.ndarray, context: Sequence[int]) -> int:
        probs = filtered_distribution(apply_repetition_penalty(logits, context, penalty), sampling)
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.size - 1))

    return draw
