"""The roofline estimate's terms: H100 peaks, the categories of non-GEMM bytes, and the
costs of kernels and programs that `cost.py` reads from compiled HLO."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

#: H100 SXM dense peaks: tensor-core FLOP/s per GEMM kind (`"f32"` is the non-tensor-core
#: rate of a float32 GEMM at `precision=HIGHEST`) and HBM3 bandwidth (`"hbm"`, bytes/s).
#: `"fp8 block"`, fp8jax's block-scaled kernel, is not a peak but a published throughput of
#: such kernels: torchao's blockwise FP8 forward, 1,234 TFLOP/s on an H100 (DeepGEMM reports
#: 1,358 on an H800 at 4096 x 7168 x 16384), some 62 % of the dense FP8 peak.
H100: dict[str, float] = {
    "fp8": 1979e12,
    "fp8 block": 1234e12,
    "bf16": 989e12,
    "f16": 989e12,
    "tf32": 494e12,
    "f32": 67e12,
    "hbm": 3.35e12,
}
#: Categories of non-GEMM bytes, in the order a kernel is tested against them.
CATEGORIES: tuple[str, ...] = ("quantize", "amax", "block partials", "transpose/copy", "rest")


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """One kernel of a compiled program, as [`fp8jax.hlo_cost`][] counts it.

    **Fields:** `name` (the HLO instruction), `computation` (where it sits), `op` (`"fusion"`,
    `"custom-call"`, `"copy"`, ...), `category` (one of `CATEGORIES` for a non-GEMM kernel,
    `None` for a GEMM), `bytes` (HBM bytes of one run: operands plus results), `flops` (of one
    run, GEMMs only), `kind` (GEMM precision: `"fp8"`, `"bf16"`, `"f16"`, `"tf32"`, `"f32"`),
    `runs` (how many times it runs: the product of the trip counts of the loops around it),
    `op_name` (the JAX name stack it came from).
    """

    name: str
    computation: str
    op: str
    category: str | None
    bytes: int
    flops: int
    kind: str | None
    runs: int
    op_name: str


def _add(a: Mapping[str, int], b: Mapping[str, int], factor: int = 1) -> dict[str, int]:
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0) + factor * value
    return out


@dataclasses.dataclass(frozen=True)
class Cost:
    """GEMM FLOPs per precision and non-GEMM HBM bytes per category of a compiled program.

    **Fields:** `flops` (GEMM kind -> FLOPs: `"fp8"`, `"bf16"`, `"f16"`, `"tf32"`, `"f32"`),
    `bytes` (category -> bytes read and written by non-GEMM kernels, categories as in
    [`fp8jax.hlo_cost`][]), `unknown_trip_counts` (names of `while` loops whose trip count the
    HLO does not state; their bodies were counted once), `kernels` (every kernel counted, a
    tuple of [`fp8jax.KernelCost`][]).

    Costs add (`a + b`) and scale by a whole number of repeats (`3 * cost`).
    """

    flops: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    unknown_trip_counts: tuple[str, ...] = ()
    kernels: tuple[KernelCost, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def gemm_flops(self) -> int:
        """FLOPs of every GEMM, whatever its precision."""
        return sum(self.flops.values())

    @property
    def total_bytes(self) -> int:
        """HBM bytes of every non-GEMM kernel."""
        return sum(self.bytes.values())

    def gemm_seconds(self, peaks: Mapping[str, float] = H100) -> float:
        """GEMM time at peak throughput: `sum(flops[kind] / peaks[kind])`."""
        total = 0.0
        for kind, flops in self.flops.items():
            if kind not in peaks:
                raise ValueError(
                    f"Cost.estimate_seconds: no peak for GEMM kind {kind!r} ({flops} FLOPs) in "
                    f"peaks={dict(peaks)!r}; add one."
                )
            total += flops / peaks[kind]
        return total

    def memory_seconds(self, peaks: Mapping[str, float] = H100) -> float:
        """Non-GEMM time at peak bandwidth: `total_bytes / peaks["hbm"]`."""
        if "hbm" not in peaks:
            raise ValueError(f"Cost.estimate_seconds: peaks={dict(peaks)!r} has no 'hbm' entry.")
        return self.total_bytes / peaks["hbm"]

    def estimate_seconds(self, peaks: Mapping[str, float] = H100) -> float:
        """Estimated run time with no overlap: GEMM FLOPs at the peak of their kind plus
        non-GEMM bytes at peak HBM bandwidth. A bound to compare programs by, not wall time."""
        return self.gemm_seconds(peaks) + self.memory_seconds(peaks)

    def __add__(self, other: Cost) -> Cost:
        if not isinstance(other, Cost):
            return NotImplemented
        return Cost(
            _add(self.flops, other.flops),
            _add(self.bytes, other.bytes),
            self.unknown_trip_counts + other.unknown_trip_counts,
            self.kernels + other.kernels,
        )

    def __mul__(self, repeats: int) -> Cost:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
            raise TypeError(
                f"Cost * repeats: repeats={repeats!r} should be a whole number >= 0 (the cost "
                "of running the program that many times)."
            )
        return Cost(
            _add({}, self.flops, repeats),
            _add({}, self.bytes, repeats),
            self.unknown_trip_counts,
            tuple(dataclasses.replace(k, runs=k.runs * repeats) for k in self.kernels),
        )

    __rmul__ = __mul__

    def __str__(self) -> str:
        lines = [f"GEMMs: {self.gemm_flops / 1e12:.3f} TFLOP"]
        lines += [f"  {kind}: {flops / 1e12:.3f} TFLOP" for kind, flops in self.flops.items()]
        lines.append(f"non-GEMM HBM traffic: {self.total_bytes / 1e9:.3f} GB")
        lines += [f"  {c}: {self.bytes.get(c, 0) / 1e9:.3f} GB" for c in CATEGORIES]
        lines.append(f"estimate at H100 peaks: {self.estimate_seconds() * 1e3:.3f} ms")
        if self.unknown_trip_counts:
            lines.append(f"loops counted once: {', '.join(self.unknown_trip_counts)}")
        return "\n".join(lines)


def total(kernels: Iterable[KernelCost], unknown: tuple[str, ...] = ()) -> Cost:
    """The `Cost` of `kernels`: their FLOPs by GEMM kind and bytes by category, times runs."""
    flops: dict[str, int] = {}
    traffic: dict[str, int] = {}
    kernels = tuple(kernels)
    for k in kernels:
        if k.kind is not None:
            flops[k.kind] = flops.get(k.kind, 0) + k.flops * k.runs
        if k.category is not None:
            traffic[k.category] = traffic.get(k.category, 0) + k.bytes * k.runs
    return Cost(flops, traffic, unknown, kernels)
