"""The building blocks every model builder shares. `linear` is the one place a builder makes a matrix product of a
checkpoint module, so a weight storage (quantised, blocked) changes it for every model at once."""

from __future__ import annotations

from ir import GraphBuilder


def linear(g: GraphBuilder, x: str, module: str, name: str, bias: bool = False) -> str:
    """x @ W.T (+ b) of the checkpoint module `module` (its `module.weight` [out, in] and `module.bias`)."""
    return g.op("linear", [x, f"{module}.weight"] + ([f"{module}.bias"] if bias else []), name)


def swiglu_mlp(g: GraphBuilder, x: str, module: str, prefix: str) -> str:
    """down(silu(gate(x)) * up(x)) of the MLP module `module` (gate_proj, up_proj, down_proj)."""
    gate = linear(g, x, f"{module}.gate_proj", prefix + "gate")
    up = linear(g, x, f"{module}.up_proj", prefix + "up")
    return linear(g, g.op("silu_mul", [gate, up], prefix + "act"), f"{module}.down_proj", prefix + "down")


def lm_head(g: GraphBuilder, h: str, embed_module: str, tied: bool) -> str:
    """The logits of hidden states `h`: the `lm_head` module, or the tied input embedding `embed_module`."""
    return linear(g, h, embed_module if tied else "lm_head", "logits")
