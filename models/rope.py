"""Rotary embedding frequencies, including the Llama 3 and linear scaling rules, and the per-frequency divisors a
GGUF file stores instead of Llama 3's rule."""

from __future__ import annotations

import math

from .config import ConfigReader

ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def read_rope(cfg: ConfigReader) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either the classic or the `rope_parameters` form."""
    params = cfg.get("rope_parameters", None)
    if params is not None:
        if not isinstance(params, dict):
            raise cfg.error("rope_parameters", "must be an object")
        sub = ConfigReader(params, f"{cfg.source} (rope_parameters)")
        theta = sub.float("rope_theta", cfg.raw.get("rope_theta", 10000.0))
        return theta, (params if params.get("rope_type", "default") != "default" else None)
    theta = cfg.float("rope_theta", 10000.0)
    scaling = cfg.get("rope_scaling", None)
    if scaling is not None and not isinstance(scaling, dict):
        raise cfg.error("rope_scaling", "must be an object or null")
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def inv_freq(cfg: ConfigReader, rotary_dim: int, theta: float, scaling: dict | None) -> list[float]:
    """The rotary inverse frequencies for `rotary_dim` rotated dims, scaled as the config says."""
    base = [1.0 / theta ** (2 * i / rotary_dim) for i in range(rotary_dim // 2)]
    if scaling is None:
        return base
    field = "rope_parameters" if "rope_parameters" in cfg.raw else "rope_scaling"
    s = ConfigReader(scaling, f"{cfg.source} ({field})")
    kind = s.choice("rope_type", ROPE_TYPES, scaling.get("type", "default"))
    if kind == "linear":
        factor = s.float("factor")
        return [f / factor for f in base]
    if kind == "freq_factors":
        factors = s.get("factors")
        if not isinstance(factors, list) or len(factors) != len(base) or not all(
                isinstance(v, float) and math.isfinite(v) and v > 0 for v in factors):
            raise s.error("factors", f"must be {len(base)} positive numbers, one per rotary frequency")
        return [f / v for f, v in zip(base, factors)]
    return _llama3(s, base)


def _llama3(s: ConfigReader, base: list[float]) -> list[float]:
    factor = s.float("factor")
    low, high = s.float("low_freq_factor"), s.float("high_freq_factor")
    if high <= low:
        raise s.error("high_freq_factor", f"must exceed low_freq_factor ({low}), got {high}")
    old_len = s.int("original_max_position_embeddings")
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out
