"""Generation settings and next-token choice: greedy, or temperature -> top-k -> top-p -> seeded draw.

Every setting is validated when the config is made, so a bad value fails before any work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

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
    return filtered_distributions(logits[None], [sampling])[0]


def filtered_distributions(logits: np.ndarray, settings: Sequence[SamplingConfig]) -> np.ndarray:
    """filtered_distribution of each row of `logits` (rows x vocab) with its own settings, computed for all rows
    at once in float64 (each row's numbers are those it gets alone)."""
    rows, vocab = logits.shape
    temperature = np.array([s.temperature for s in settings], np.float64)
    top_k = np.array([s.top_k for s in settings], np.int64)
    top_p = np.array([s.top_p for s in settings], np.float64)
    scaled = logits.astype(np.float64) / temperature[:, None]
    keep = np.isfinite(scaled)
    limited = (0 < top_k) & (top_k < vocab)
    if limited.any():  # the k-th largest of a row, as np.partition finds it
        kth = np.sort(scaled[limited], axis=1)[np.arange(limited.sum()), vocab - top_k[limited]]
        keep[limited] &= scaled[limited] >= kth[:, None]
    peak = np.where(keep, scaled, -np.inf).max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        probs = np.where(keep, np.exp(scaled - peak), 0.0)
    probs /= probs.sum(axis=1, keepdims=True)
    nucleus = top_p < 1.0
    if nucleus.any():
        part = probs[nucleus]
        order = np.argsort(-part, axis=1, kind="stable")  # descending probability, lower id first
        ranked = np.take_along_axis(part, order, axis=1)
        mass_before = np.cumsum(ranked, axis=1) - ranked
        np.put_along_axis(part, order, np.where(mass_before >= top_p[nucleus][:, None], 0.0, ranked), axis=1)
        probs[nucleus] = part / part.sum(axis=1, keepdims=True)
    return probs


class TokenPicker:
    """One request's next-token rule: argmax for greedy, a draw from its own seeded generator for sampling."""

    def __init__(self, config: GreedyGenerationConfig):
        self.config = config
        self.sampling = config.sampling if isinstance(config, SamplingGenerationConfig) else None
        self.rng = np.random.default_rng(self.sampling.seed) if self.sampling else None

    def __call__(self, logits: np.ndarray, context: Sequence[int]) -> int:
        """The next token after one row of logits."""
        return pick_tokens(logits[None], [self], [context])[0]


def make_picker(config: GreedyGenerationConfig) -> TokenPicker:
    """The next-token rule of a config (one generator per request)."""
    return TokenPicker(config)


def pick_tokens(logits: np.ndarray, pickers: Sequence[TokenPicker], contexts: Sequence[Sequence[int]]) -> list[int]:
    """The next token of each row of `logits` (rows x vocab) by its request's picker, given the tokens the request
    has so far (for repetition penalties): greedy rows by one argmax, sampled rows by one vectorised filtering and
    one uniform draw each from their own generators, so every row gets the token it would get alone."""
    logits = np.stack([apply_repetition_penalty(row, context, picker.config.repetition_penalty)
                       for row, picker, context in zip(logits, pickers, contexts)])
    tokens = np.argmax(logits, axis=1)
    sampled = [i for i, picker in enumerate(pickers) if picker.sampling]
    if sampled:
        probs = filtered_distributions(logits[sampled], [pickers[i].sampling for i in sampled])
        cdf = np.cumsum(probs, axis=1)
        target = np.array([pickers[i].rng.random() for i in sampled]) * cdf[:, -1]
        tokens[sampled] = np.minimum((cdf <= target[:, None]).sum(axis=1), probs.shape[1] - 1)
    return [int(t) for t in tokens]
