"""Sampling semantics (temperature -> top-k with ties -> top-p -> seeded draw), checked without a model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runtime import GenerationConfigError, GreedyGenerationConfig, SamplingConfig, SamplingGenerationConfig
from runtime.sampling import apply_repetition_penalty, filtered_distribution, make_picker

LOGITS = np.array([2.0, 1.0, 1.0, 0.5, -1.0, 3.0, 1.0, -2.0])


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature_scales_logits_first():
    for t in (0.5, 1.0, 2.0):
        np.testing.assert_allclose(filtered_distribution(LOGITS, SamplingConfig(temperature=t)), softmax(LOGITS / t), rtol=1e-12)


def test_top_k_keeps_ties_at_the_boundary():
    probs = filtered_distribution(LOGITS, SamplingConfig(top_k=3))  # 3.0, 2.0, then three tokens tied at 1.0
    assert set(np.flatnonzero(probs)) == {0, 1, 2, 5, 6}
    kept = np.array([0, 1, 2, 5, 6])
    np.testing.assert_allclose(probs[kept], softmax(LOGITS[kept]), rtol=1e-12)
    assert set(np.flatnonzero(filtered_distribution(LOGITS, SamplingConfig(top_k=2)))) == {0, 5}
    assert np.count_nonzero(filtered_distribution(LOGITS, SamplingConfig(top_k=0))) == LOGITS.size


def test_top_p_boundaries():
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125]))
    # the smallest set whose mass reaches top_p is kept
    assert set(np.flatnonzero(filtered_distribution(logits, SamplingConfig(top_p=0.5)))) == {0}
    assert set(np.flatnonzero(filtered_distribution(logits, SamplingConfig(top_p=0.5000001)))) == {0, 1}
    assert set(np.flatnonzero(filtered_distribution(logits, SamplingConfig(top_p=0.75)))) == {0, 1}
    assert set(np.flatnonzero(filtered_distribution(logits, SamplingConfig(top_p=0.76)))) == {0, 1, 2}
    assert set(np.flatnonzero(filtered_distribution(logits, SamplingConfig(top_p=0.01)))) == {0}
    assert np.count_nonzero(filtered_distribution(logits, SamplingConfig(top_p=1.0))) == 4
    np.testing.assert_allclose(filtered_distribution(logits, SamplingConfig(top_p=0.75))[:2], [2 / 3, 1 / 3])


def test_order_is_temperature_then_top_k_then_top_p():
    cfg = SamplingConfig(temperature=0.7, top_k=4, top_p=0.8)
    scaled = LOGITS / 0.7
    keep = scaled >= np.sort(scaled)[-4]
    p = np.where(keep, softmax(np.where(keep, scaled, -np.inf)), 0)
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    p[order[before >= 0.8]] = 0
    np.testing.assert_allclose(filtered_distribution(LOGITS, cfg), p / p.sum(), rtol=1e-12)


def test_matches_transformers_warpers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.standard_normal(64).astype(np.float32) * 3
        context = rng.integers(0, 64, 10)
        t, k, p, penalty = float(rng.uniform(0.3, 2)), int(rng.integers(0, 20)), float(rng.uniform(0.2, 1)), 1.3
        scores = torch.tensor(logits)[None]
        ids = torch.tensor(context)[None]
        scores = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores)
        scores = TemperatureLogitsWarper(t)(ids, scores)
        if k:
            scores = TopKLogitsWarper(k)(ids, scores)
        if p < 1:
            scores = TopPLogitsWarper(p)(ids, scores)
        want = torch.softmax(scores.double(), -1)[0].numpy()
        got = filtered_distribution(apply_repetition_penalty(logits, context, penalty), SamplingConfig(t, k, p))
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_repetition_penalty_as_transformers_defines_it():
    logits = np.array([2.0, -2.0, 1.0, -1.0], dtype=np.float32)
    np.testing.assert_allclose(apply_repetition_penalty(logits, [0, 1, 1], 2.0), [1.0, -4.0, 1.0, -1.0])
    assert apply_repetition_penalty(logits, [0], 1.0) is logits


def test_seed_determinism_and_different_seeds():
    logits = np.linspace(0, 2, 50).astype(np.float32)

    def draws(seed):
        pick = make_picker(SamplingGenerationConfig(10, sampling=SamplingConfig(seed=seed)))
        return [pick(logits, []) for _ in range(200)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    unseeded = make_picker(SamplingGenerationConfig(10, sampling=SamplingConfig(seed=None)))
    assert len({unseeded(logits, []) for _ in range(200)}) > 5


def test_greedy_picks_the_max_logit():
    pick = make_picker(GreedyGenerationConfig(5))
    assert pick(LOGITS, []) == 5
    assert make_picker(GreedyGenerationConfig(5, repetition_penalty=10.0))(LOGITS, [5]) == 0


def test_sampled_frequencies_match_the_filtered_distribution():
    """Chi-square goodness of fit with a fixed seed; the statistic must stay below the p=0.001 critical value."""
    cfg = SamplingGenerationConfig(10, sampling=SamplingConfig(temperature=0.8, top_k=5, top_p=0.95, seed=1234))
    probs = filtered_distribution(LOGITS, cfg.sampling)
    pick = make_picker(cfg)
    n = 20000
    counts = np.bincount([pick(LOGITS, []) for _ in range(n)], minlength=LOGITS.size)
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}[df]
    assert chi2 < critical, (chi2, df)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=0.0), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature="hot"), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=-0.1), "top_p"),
    (dict(seed=-3), "seed"), (dict(seed="abc"), "seed"),
])
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(GenerationConfigError, match=f"^{field} "):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-5), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"), (dict(eos_token_ids=[-1]), "eos_token_ids"),
    (dict(eos_token_ids="2"), "eos_token_ids"), (dict(eos_token_ids=[1.5]), "eos_token_ids"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(stop_strings="stop"), "stop_strings"), (dict(stop_strings=[""]), "stop_strings"),
])
def test_invalid_generation_values(kwargs, field):
    with pytest.raises(GenerationConfigError, match=f"^{field} "):
        GreedyGenerationConfig(**kwargs)
    with pytest.raises(GenerationConfigError, match=f"^{field} "):
        SamplingGenerationConfig(**kwargs)


def test_sampling_must_be_a_sampling_config():
    with pytest.raises(GenerationConfigError, match="^sampling "):
        SamplingGenerationConfig(5, sampling={"temperature": 1.0})
