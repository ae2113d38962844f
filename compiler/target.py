"""Compilation targets: the host CPU as LLVM sees it, and the SIMD width its schedules use."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.target import codegen

from ir.errors import RudaError
from ir.contract import TargetSpec
from ir.cpu_features import AMX_FEATURES, CHECKED_FEATURES, host_cpu_flags

from .options import MATMUL_PRECISIONS

TRIPLE = "x86_64-linux-gnu"


class TargetError(RudaError):
    """An unknown or unusable compilation target."""

    exit_code = 6


@dataclass(frozen=True)
class CpuTarget:
    """An LLVM CPU target: its CPU name, the features it relies on, its float32 SIMD lanes, and whether prefill
    products of bfloat16 weights round activations to bfloat16 to run on AMX tiles."""

    mcpu: str
    features: tuple[str, ...]
    matmul_precision: str = "float32"

    @property
    def amx(self) -> bool:
        """Prefill products of bfloat16 weights run on AMX tiles."""
        return self.matmul_precision == "bfloat16"

    @property
    def lanes(self) -> int:
        """float32 elements in one SIMD register."""
        return 16 if "avx512f" in self.features else 8 if "avx2" in self.features else 4

    def tvm_target(self) -> tvm.target.Target:
        """The TVM target object."""
        return tvm.target.Target({"kind": "llvm", "mtriple": TRIPLE, "mcpu": self.mcpu})

    def describe(self) -> TargetSpec:
        """The target as the manifest records it."""
        return TargetSpec("llvm", mtriple=TRIPLE, mcpu=self.mcpu, features=self.features,
                          matmul_precision=self.matmul_precision)


def cpu_target(mcpu: str | None = None, matmul_precision: str = "float32") -> CpuTarget:
    """The target for `mcpu` (default: this machine's CPU, limited to the features it really has) and the
    precision of prefill matrix products (bfloat16: on AMX tiles, so only for CPUs that have them)."""
    if matmul_precision not in MATMUL_PRECISIONS:
        raise TargetError(f"--matmul-precision {matmul_precision!r} is not one of {', '.join(MATMUL_PRECISIONS)}")
    name = mcpu or codegen.llvm_get_system_cpu()
    if not codegen.llvm_is_valid_cpu(name, TRIPLE):
        raise TargetError(f"--mcpu {name!r} is not a CPU LLVM knows; try e.g. x86-64-v3, skylake-avx512, znver4")
    implied = set(codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mtriple": TRIPLE, "mcpu": name})))
    features = {f for f in CHECKED_FEATURES if f in implied and (matmul_precision == "bfloat16" or f not in AMX_FEATURES)}
    if matmul_precision == "bfloat16" and not features.issuperset(AMX_FEATURES):
        raise TargetError(f"--matmul-precision bfloat16 runs on AMX tiles, which CPU {name!r} does not have (AMX-BF16 "
                          "came with Intel Sapphire Rapids); build with --matmul-precision float32")
    if mcpu is None:
        flags = host_cpu_flags()
        missing = {f for f in features if CHECKED_FEATURES[f] not in flags}
        if missing and flags:
            raise TargetError(f"LLVM names this CPU {name!r}, but it lacks {sorted(missing)}; pass --mcpu with a CPU "
                              "model this machine fully supports (e.g. x86-64-v3)")
    return CpuTarget(name, tuple(sorted(features)), matmul_precision)

