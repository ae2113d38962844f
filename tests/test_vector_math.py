"""The CPU kernels' exp and sigmoid arithmetic against numpy: near float32 rounding everywhere, exact on specials."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te

from compiler.target import cpu_target
from schedules import cpu
from schedules.vector_math import softmax_exp

SPECIALS = np.array([np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30], np.float32)


@pytest.mark.parametrize("name,op,reference", [
    ("exp", te.exp, np.exp),
    ("sigmoid", te.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
])
def test_vectorised_math_matches_numpy(name, op, reference):
    values = np.concatenate([np.linspace(-120, 95, 200_000, dtype=np.float32), SPECIALS, [np.nan, 88.72, -87.3]])
    values = np.resize(values.astype(np.float32), (len(values) + 15) // 16 * 16)  # whole vectors, so the schedule vectorises
    x = te.placeholder(values.shape, "float32", name="x")
    func = te.create_prim_func([x, te.compute(x.shape, lambda i: op(x[i]), name=name)])
    target = cpu_target()
    lib = tvm.compile(cpu.schedule(func, name, {}, target), target.tvm_target())
    out = tvm.runtime.empty(values.shape, "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(values), out)
    got = out.numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        want = reference(values.astype(np.float64))
        want32 = want.astype(np.float32)
    normal = np.isfinite(want32) & (np.abs(want32) >= np.finfo(np.float32).tiny)
    assert np.max(np.abs(got[normal] - want[normal]) / np.abs(want[normal])) < 3e-7
    special = np.isin(values, SPECIALS)
    np.testing.assert_array_equal(got[special], want32[special])  # inf and 0 exact
    assert np.isnan(got[np.isnan(values)]).all()
    assert "expf" not in lib.mod.inspect_source("asm")  # no libm call per element


def test_softmax_exp_equals_exp_over_a_softmax_range_and_stays_tiny_below():
    """softmax_exp (no NaN test, one power of two) gives exp's bits for x in [-87, 0] and e^-87 below (never 0
    or a subnormal)."""
    values = np.concatenate([np.linspace(-87, 0, 100_000, dtype=np.float32), [-87.5, -200.0, -3e38]])
    values = np.resize(values.astype(np.float32), (len(values) + 15) // 16 * 16)
    x = te.placeholder(values.shape, "float32", name="x")
    outs = [te.compute(x.shape, lambda i: f(x[i]), name=name) for name, f in (("exp", te.exp), ("soft", softmax_exp))]
    target = cpu_target()
    sch_func = cpu.schedule(te.create_prim_func([x, *outs]), "exp", {}, target)
    lib = tvm.compile(sch_func, target.tvm_target())
    got = [tvm.runtime.empty(values.shape, "float32", tvm.cpu()) for _ in outs]
    lib["main"](tvm.runtime.tensor(values), *got)
    full, soft = (g.numpy() for g in got)
    inside = values >= -87
    np.testing.assert_array_equal(soft[inside], full[inside])
    assert values[0] == -87 and (soft[~inside] == soft[0]).all() and soft[0] >= np.finfo(np.float32).tiny
