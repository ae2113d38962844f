"""Compilation targets: the host CPU as LLVM sees it, and the SIMD width its schedules use."""

from __future__ import annotations

from dataclasses import dataclass, replace

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


BF16_PATHS = {"amx": AMX_FEATURES, "avx512bf16": ("avx512bf16", "avx512f")}  # in order of preference
BF16_PATH_NAMES = {"amx": "AMX tiles", "avx512bf16": "AVX512-BF16 dot products"}
# CPUs that issue `vdpbf16ps` as fast as their float32 FMAs (AMD Zen 4 and 5, the only Zen with AVX512-BF16), so that
# a dot product of pairs does two FMAs' work: prompt chunks' attention runs its products on it there. An Intel Xeon
# with AMX issues it at a quarter of its FMA rate (docs/performance.md): there float32 attention is faster.
EQUAL_RATE_BF16_DOT_CPUS = ("znver",)
# CPUs whose hardware prefetchers alone keep some one-row decode products at the memory's rate (AMD Zen 4: which
# ones, `schedules.cpu._rows_gemv`); an Intel Xeon and Zen 5 run faster with software prefetches (docs/performance.md).
HARDWARE_PREFETCH_CPUS = ("znver4",)
# Intel cores from Ice Lake's Sunny Cove on: a 48 KiB L1 data cache and 1.25-2 MiB of L2 a core
INTEL_WIDE_L1_CPUS = ("icelake", "tigerlake", "rocketlake", "alderlake", "raptorlake", "meteorlake", "arrowlake",
                      "lunarlake", "pantherlake", "sapphirerapids", "emeraldrapids", "graniterapids", "diamondrapids")
# CPUs whose cores have a 48 KiB L1 data cache (those and AMD Zen 5); others 32 KiB. Where a few-row decode product's
# x rows and a weight row outgrow it, the product reads x in depth blocks (`schedules.cpu`)
WIDE_L1_CPUS = (*INTEL_WIDE_L1_CPUS, "znver5")
# CPUs on which one x row's widening form (`schedules.cpu._rows_gemv`, the float32 build's decode products) of
# bfloat16 weights streams faster with its prefetches eager: addresses not bounded to the weights (a prefetch past
# their end is harmless), so they issue as plain instructions, and streams of half a page. From memory, AMD Zen 5:
# rows of 896 and 1536 1.15-1.28x; the Intel Xeon with AMX: 896 to 8960 deep 1.04-1.07x, deeper level
# (docs/performance.md); float16 weights and the dot-product form keep bounded ones
EAGER_PREFETCH_CPUS = ("znver5", *INTEL_WIDE_L1_CPUS)
# CPUs on which a bf16 build's one-row decode products of rows shorter than a page take that eager widening form
# rather than dot products: AMD Zen 5, Qwen3.5-0.8B's bf16 build decoded 1.21x faster so (docs/performance.md)
SHORT_ROWS_WIDENED_CPUS = ("znver5",)
# CPUs on which one x row streams its weights in one pass at any depth, x read from L2 where it and a weight row
# outgrow L1 together: the Intel Xeon with AMX, [1536, 8960], [3584, 18944] and [4096, 14336] from memory 1.05-1.07x
# faster than in depth blocks, where AMD Zen 4 ran 1.2-1.4x faster in them (docs/performance.md)
ONE_PASS_ROW_CPUS = INTEL_WIDE_L1_CPUS
# CPUs that run a 512-bit FMA as two 256-bit halves (AMD Zen 4): the register tile of a few-row product with 8 or 16
# x rows ran 1.3-1.4x faster there with 8 accumulators than with 16 (docs/performance.md)
HALF_WIDTH_AVX512_CPUS = ("znver4",)
# Qwen3.5-0.8B decode, Intel Xeon with AMX, alternating: the delta rule's time in a step 2.0-2.1 ms with one vector
# (a state row read as one 64-byte line in eight), 1.5 with four, 1.7-2.2 with eight; prefill 1.04-1.07x faster
SCAN_VECTORS = 4


@dataclass(frozen=True)
class CpuTarget:
    """An LLVM CPU target: its CPU name, the features it relies on, its float32 SIMD lanes, the precision of prefill
    products of bfloat16 weights (`auto` until `for_weights` resolves it), and the instructions the CPU offers for
    bfloat16 products (`bf16_path`: amx, avx512bf16 or None)."""

    mcpu: str
    features: tuple[str, ...]
    matmul_precision: str = "float32"
    bf16_path: str | None = None

    @property
    def bf16_products(self) -> str | None:
        """Where prefill products of bfloat16 weights run in bfloat16 (amx, avx512bf16), or None: float32."""
        return self.bf16_path if self.matmul_precision == "bfloat16" else None

    @property
    def bf16_attention(self) -> str | None:
        """Where prompt chunks' attention products run in bfloat16 (amx, avx512bf16), or None: float32. Dot products
        only where the CPU issues them at its FMA rate."""
        if self.bf16_products == "avx512bf16" and not self.mcpu.startswith(EQUAL_RATE_BF16_DOT_CPUS):
            return None
        return self.bf16_products

    @property
    def hardware_prefetch(self) -> bool:
        """Whether some one-row decode products leave prefetching to the hardware."""
        return self.mcpu in HARDWARE_PREFETCH_CPUS

    @property
    def eager_prefetch(self) -> bool:
        """Whether one x row's widening-form products issue their prefetches eagerly (EAGER_PREFETCH_CPUS)."""
        return self.mcpu.startswith(EAGER_PREFETCH_CPUS)

    @property
    def short_rows_widened(self) -> bool:
        """Whether a bf16 build's one-row products of short rows take the widening form (SHORT_ROWS_WIDENED_CPUS)."""
        return self.mcpu.startswith(SHORT_ROWS_WIDENED_CPUS)

    @property
    def one_pass_row(self) -> bool:
        """Whether one x row's product reads its weights in one pass whatever the depth (ONE_PASS_ROW_CPUS)."""
        return self.mcpu.startswith(ONE_PASS_ROW_CPUS)

    @property
    def gemv_accumulators(self) -> int:
        """Accumulators a few-row product's register tile holds at most: half the SIMD registers (AVX-512 has 32,
        AVX2 16), a quarter where the CPU splits its 512-bit FMAs."""
        return 8 if self.lanes < 16 or self.mcpu in HALF_WIDTH_AVX512_CPUS else 16

    @property
    def l1_bytes(self) -> int:
        """The size of a core's L1 data cache."""
        return (48 if self.mcpu.startswith(WIDE_L1_CPUS) else 32) * 1024

    @property
    def lanes(self) -> int:
        """float32 elements in one SIMD register."""
        return 16 if "avx512f" in self.features else 8 if "avx2" in self.features else 4

    @property
    def scan_lanes(self) -> int:
        """State columns one task of a sequential scan carries (compiler.kernels.make_kernel): SCAN_VECTORS
        registers' worth, so that each row of a state a task reads is a run of whole cache lines."""
        return SCAN_VECTORS * self.lanes

    def for_weights(self, dtype: str) -> CpuTarget:
        """The target with `auto` precision resolved for a checkpoint whose matrices are `dtype`: bfloat16 products
        for bfloat16 weights where the CPU has a path for them, float32 ones otherwise."""
        if self.matmul_precision != "auto":
            return self
        if dtype != "bfloat16" or self.bf16_path is None:
            return replace(self, matmul_precision="float32")
        return replace(self, matmul_precision="bfloat16", features=_with_path(self.features, self.bf16_path))

    def tvm_target(self) -> tvm.target.Target:
        """The TVM target object."""
        return tvm.target.Target({"kind": "llvm", "mtriple": TRIPLE, "mcpu": self.mcpu,
                                  "mattr": [f"+{f}" for f in self.features]})

    def describe(self) -> TargetSpec:
        """The target as the manifest records it."""
        return TargetSpec("llvm", mtriple=TRIPLE, mcpu=self.mcpu, features=self.features,
                          matmul_precision=self.matmul_precision, bf16_products=self.bf16_products)


def _with_path(features: tuple[str, ...], path: str) -> tuple[str, ...]:
    """`features` and those the bfloat16 products on `path` need (AMX's are left out of other builds: a float32
    build runs on a host whose AMX is off)."""
    return tuple(sorted(set(features) | set(BF16_PATHS[path])))


def cpu_target(mcpu: str | None = None, matmul_precision: str = "float32") -> CpuTarget:
    """The target for `mcpu` (default: this machine's CPU, limited to the features it really has) and the
    precision of prefill matrix products (bfloat16: on AMX tiles, else AVX512-BF16 dot products, so only for CPUs
    with one of them; auto: decided per checkpoint by `CpuTarget.for_weights`)."""
    if matmul_precision not in MATMUL_PRECISIONS:
        raise TargetError(f"--matmul-precision {matmul_precision!r} is not one of {', '.join(MATMUL_PRECISIONS)}")
    name = mcpu or codegen.llvm_get_system_cpu()
    if not codegen.llvm_is_valid_cpu(name, TRIPLE):
        raise TargetError(f"--mcpu {name!r} is not a CPU LLVM knows; try e.g. x86-64-v3, skylake-avx512, znver4")
    implied = set(codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mtriple": TRIPLE, "mcpu": name})))
    offered = {f for f in CHECKED_FEATURES if f in implied}
    flags = host_cpu_flags() if mcpu is None else set()
    if flags:
        missing = {f for f in offered - set(AMX_FEATURES) if CHECKED_FEATURES[f] not in flags}
        if missing:
            raise TargetError(f"LLVM names this CPU {name!r}, but it lacks {sorted(missing)}; pass --mcpu with a CPU "
                              "model this machine fully supports (e.g. x86-64-v3)")
        # The host's own features, not only those its LLVM name implies: AMX that the host turned off gives no AMX
        # path, and a virtual CPU whose model number LLVM reads as an older CPU keeps the features it really has.
        offered = {f for f, flag in CHECKED_FEATURES.items() if flag in flags}
    path = next((p for p, needs in BF16_PATHS.items() if offered.issuperset(needs)), None)
    if matmul_precision == "bfloat16" and path is None:
        raise TargetError(f"--matmul-precision bfloat16 runs on AMX tiles or AVX512-BF16 dot products, and CPU "
                          f"{name!r} has neither (AVX512-BF16 came with Intel Cooper Lake and AMD Zen 4, AMX with "
                          "Intel Sapphire Rapids); build with --matmul-precision float32 (or auto: bfloat16 where the "
                          "CPU can)")
    features = tuple(sorted(offered - set(AMX_FEATURES)))
    target = CpuTarget(name, features, matmul_precision, path)
    return replace(target, features=_with_path(features, path)) if target.bf16_products else target
