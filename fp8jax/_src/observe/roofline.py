"""The roofline estimate's terms: H100 peaks and link rates, the categories of non-GEMM
bytes, and the costs of kernels, collectives and programs that `cost.py` reads from compiled
HLO."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

#: H100 SXM dense peaks: tensor-core FLOP/s per GEMM kind (`"f32"` is the non-tensor-core
#: rate of a float32 GEMM at `precision=HIGHEST`; `"f64"` FP64 tensor cores; `"int8"` INT8
#: tensor cores and `"int32"` CUDA cores' INT32, in OP/s) and HBM3 bandwidth (`"hbm"`,
#: bytes/s).
#: `"fp8 block"`, fp8jax's block-scaled kernel, is not a peak but a published throughput of
#: such kernels: torchao's blockwise FP8 forward, 1,234 TFLOP/s on an H100 (DeepGEMM reports
#: 1,358 on an H800 at 4096 x 7168 x 16384), some 62 % of the dense FP8 peak.
#:
#: Links, bytes/s one way per GPU: `"nvlink"`, NVLink 4 within a node (NVIDIA's H100 SXM
#: datasheet: 900 GB/s in all, so 450 GB/s each way, through NVSwitch to any GPU of the
#: node); `"infiniband"`, across nodes (a DGX H100 has one 400 Gb/s ConnectX-7 NDR port per
#: GPU: 50 GB/s each way). These are peak link rates: the bus bandwidth NCCL measures is
#: lower.
H100: dict[str, float] = {
    "fp8": 1979e12,
    "fp8 block": 1234e12,
    "bf16": 989e12,
    "f16": 989e12,
    "tf32": 494e12,
    "f32": 67e12,
    "f64": 67e12,
    "int8": 1979e12,
    "int32": 33.5e12,
    "hbm": 3.35e12,
    "nvlink": 450e9,
    "infiniband": 50e9,
}
#: GPUs per node (a DGX/HGX H100 has 8 on one NVSwitch fabric): devices `8k .. 8k+7` of a
#: program are node `k`, and a collective whose group spans nodes crosses InfiniBand.
GPUS_PER_NODE = 8
#: Links a collective may cross, the keys of their rates in `H100`.
LINKS: tuple[str, ...] = ("nvlink", "infiniband")
#: Categories of non-GEMM bytes, in the order a kernel is tested against them.
CATEGORIES: tuple[str, ...] = ("quantize", "amax", "block partials", "transpose/copy", "rest")


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """One kernel of a compiled program, as [`fp8jax.hlo_cost`][] counts it.

    **Fields:** `name` (the HLO instruction), `computation` (where it sits), `op` (`"fusion"`,
    `"custom-call"`, `"copy"`, ...), `category` (one of `CATEGORIES` for a non-GEMM kernel,
    `None` for a GEMM), `bytes` (HBM bytes of one run: operands plus results; 0 for a GEMM,
    which the model takes as bound by its FLOPs), `flops` (of one run, GEMMs only), `kind`
    (GEMM precision, a key of `H100`'s peaks: `"fp8"`, `"bf16"`,
    `"tf32"`, ..., as [`fp8jax.hlo_cost`][] lists them; `None` for another kernel),
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


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective of a compiled program (all-gather, all-reduce, reduce-scatter,
    all-to-all, collective-permute), as [`fp8jax.hlo_cost`][] counts it.

    **Fields:** `name` (the HLO instruction), `computation` (where it sits), `op`
    (`"all-gather"`, ...: the async `-start` form counted as its collective), `dtype` (the
    element type it moves: `"f8e4m3fn"` for an FP8 all-gather), `bytes` (the whole array of one
    device, one run: an all-gather's result, the operand of the others), `devices` (the size
    of its replica groups; 2 for a permute that moves data, 1 for one that does not), `link`
    (`"nvlink"` when every group lies in one node, else `"infiniband"`), `runs`, `op_name`.

    `wire_bytes` is what one device sends in one run, by the ring algorithm: `(n-1)/n` of
    the array for an all-gather, reduce-scatter or all-to-all, `2(n-1)/n` for an all-reduce
    (a reduce-scatter, then an all-gather), the array for a permute. A ragged all-to-all
    (`"ragged-all-to-all"`, expert parallelism's dispatch and combine) counts the smaller of
    its rows to send and its output buffer, of which `(n-1)/n` leave the device: uniform
    routing's share, an estimate (what moves depends on where tokens are routed at run time).
    """

    name: str
    computation: str
    op: str
    dtype: str
    bytes: int
    devices: int
    link: str
    runs: int
    op_name: str

    @property
    def wire_bytes(self) -> int:
        """Bytes one device sends (and receives) in one run, by the ring model."""
        n = self.devices
        if n <= 1:
            return 0
        if self.op == "collective-permute":
            return self.bytes
        return (2 if self.op == "all-reduce" else 1) * self.bytes * (n - 1) // n

    def seconds(self, peaks: Mapping[str, float] = H100) -> float:
        """Time of all its runs at the link's rate: `runs * wire_bytes / peaks[link]`."""
        _check_peaks(peaks, "CollectiveCost.seconds")
        return self.runs * self.wire_bytes / _rate(peaks, self.link, "CollectiveCost.seconds")


def _rate(peaks: Mapping[str, float], link: str, method: str) -> float:
    if link not in peaks:
        raise ValueError(
            f"{method}: no rate for link {link!r} in peaks={dict(peaks)!r}; "
            f"add one (bytes/s one way per GPU; links: {LINKS})."
        )
    return peaks[link]


def _check_peaks(peaks: Any, method: str) -> None:
    if not isinstance(peaks, Mapping):
        raise TypeError(
            f"{method}: peaks={peaks!r} should be a dict of rates, as the H100's it "
            "takes by default (GEMM kind -> FLOP/s; 'hbm' and the links -> bytes/s): a GPU "
            "is given by its rates, not its name."
        )
    # A rate of 0 divided by zero, a negative one gave a negative time, a string a bare
    # "unsupported operand" TypeError.
    bad = {
        key: rate
        for key, rate in peaks.items()
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not rate > 0
    }
    if bad:
        raise ValueError(
            f"{method}: peaks has rates {bad!r}; each rate should be a number > 0 (FLOP/s for "
            "a GEMM kind, bytes/s for 'hbm' and the links)."
        )


def is_whole(n: Any) -> bool:
    """Whether `n` is a whole number: a Python or NumPy integer, not a bool."""
    return isinstance(n, int | np.integer) and not isinstance(n, bool)


def _add(a: Mapping[str, int], b: Mapping[str, int], factor: int = 1) -> dict[str, int]:
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0) + factor * value
    return out


@dataclasses.dataclass(frozen=True)
class Cost:
    """GEMM FLOPs per precision, non-GEMM HBM bytes per category and the bytes collectives
    send, per device, of a compiled program.

    **Fields:** `flops` (GEMM kind -> FLOPs: `"fp8"`, `"bf16"`, `"tf32"`, ..., the kinds of
    [`fp8jax.hlo_cost`][], each a key of `H100`'s peaks),
    `bytes` (category -> bytes read and written by non-GEMM kernels, categories as in
    [`fp8jax.hlo_cost`][]), `unknown_trip_counts` (names of `while` loops whose trip count the
    HLO does not state; their bodies were counted once), `kernels` (every kernel counted, a
    tuple of [`fp8jax.KernelCost`][]), `communication` (collective -> bytes one device sends,
    by the ring model: `"all-gather"`, `"all-reduce"`, `"reduce-scatter"`, `"all-to-all"`,
    `"ragged-all-to-all"`, `"collective-permute"`), `link_bytes` (the same bytes by the link
    they cross: `"nvlink"`, `"infiniband"`), `collectives` (every collective counted, a tuple of
    [`fp8jax.CollectiveCost`][]).

    Costs add (`a + b`, `sum(costs)`) and scale by a whole number of repeats (`3 * cost`).
    """

    flops: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    unknown_trip_counts: tuple[str, ...] = ()
    kernels: tuple[KernelCost, ...] = dataclasses.field(default=(), repr=False, compare=False)
    communication: dict[str, int] = dataclasses.field(default_factory=dict)
    link_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    collectives: tuple[CollectiveCost, ...] = dataclasses.field(
        default=(), repr=False, compare=False
    )

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
        _check_peaks(peaks, "Cost.gemm_seconds")
        total = 0.0
        for kind, flops in self.flops.items():
            if kind not in peaks:
                raise ValueError(
                    f"Cost.gemm_seconds: no peak for GEMM kind {kind!r} ({flops} FLOPs) in "
                    f"peaks={dict(peaks)!r}; add one."
                )
            total += flops / peaks[kind]
        return total

    def memory_seconds(self, peaks: Mapping[str, float] = H100) -> float:
        """Non-GEMM time at peak bandwidth: `total_bytes / peaks["hbm"]`."""
        _check_peaks(peaks, "Cost.memory_seconds")
        if "hbm" not in peaks:
            raise ValueError(f"Cost.memory_seconds: peaks={dict(peaks)!r} has no 'hbm' entry.")
        return self.total_bytes / peaks["hbm"]

    @property
    def communication_bytes(self) -> int:
        """Bytes one device sends in every collective (the ring model's)."""
        return sum(self.communication.values())

    def communication_seconds(self, peaks: Mapping[str, float] = H100) -> float:
        """Collective time at peak link rates: `sum(link_bytes[link] / peaks[link])`."""
        _check_peaks(peaks, "Cost.communication_seconds")
        method = "Cost.communication_seconds"
        return sum(b / _rate(peaks, link, method) for link, b in self.link_bytes.items())

    def estimate_seconds(
        self, peaks: Mapping[str, float] = H100, *, overlap: bool = False
    ) -> float:
        """Estimated run time: GEMM FLOPs at the peak of their kind plus non-GEMM bytes at
        peak HBM bandwidth, plus collectives at peak link rates (`overlap=False`: nothing
        overlaps), or the larger of compute and communication (`overlap=True`: collectives
        wholly hidden under the kernels, as far as they can be). The two bound a sharded
        step; for one device they are equal. A bound to compare programs by, not wall time."""
        _check_peaks(peaks, "Cost.estimate_seconds")
        if not isinstance(overlap, bool | np.bool_):
            raise TypeError(
                f"Cost.estimate_seconds: overlap={overlap!r}: should be True (collectives "
                "hidden under the kernels) or False (nothing overlaps)."
            )
        compute = self.gemm_seconds(peaks) + self.memory_seconds(peaks)
        communication = self.communication_seconds(peaks)
        return max(compute, communication) if overlap else compute + communication

    def __add__(self, other: Cost) -> Cost:
        if not isinstance(other, Cost):
            return NotImplemented
        return Cost(
            _add(self.flops, other.flops),
            _add(self.bytes, other.bytes),
            self.unknown_trip_counts + other.unknown_trip_counts,
            self.kernels + other.kernels,
            _add(self.communication, other.communication),
            _add(self.link_bytes, other.link_bytes),
            self.collectives + other.collectives,
        )

    def __radd__(self, other: Any) -> Cost:
        # `sum(costs)` starts from 0; any other number is not a Cost.
        if isinstance(other, int) and not isinstance(other, bool) and other == 0:
            return self
        return NotImplemented

    def __mul__(self, repeats: int) -> Cost:
        if not is_whole(repeats) or repeats < 0:
            raise TypeError(
                f"Cost * repeats: repeats={repeats!r} should be a whole number >= 0 (the cost "
                "of running the program that many times)."
            )
        repeats = int(repeats)
        return Cost(
            _add({}, self.flops, repeats),
            _add({}, self.bytes, repeats),
            self.unknown_trip_counts,
            tuple(dataclasses.replace(k, runs=k.runs * repeats) for k in self.kernels),
            _add({}, self.communication, repeats),
            _add({}, self.link_bytes, repeats),
            tuple(dataclasses.replace(c, runs=c.runs * repeats) for c in self.collectives),
        )

    __rmul__ = __mul__

    def __str__(self) -> str:
        lines = [f"GEMMs: {self.gemm_flops / 1e12:.4g} TFLOP"]
        lines += [f"  {kind}: {flops / 1e12:.4g} TFLOP" for kind, flops in self.flops.items()]
        lines.append(f"non-GEMM HBM traffic: {self.total_bytes / 1e9:.4g} GB")
        lines += [f"  {c}: {self.bytes.get(c, 0) / 1e9:.4g} GB" for c in CATEGORIES]
        if self.communication:
            lines.append(
                f"collectives, bytes sent per device: {self.communication_bytes / 1e9:.4g} GB"
            )
            lines += [f"  {op}: {b / 1e9:.4g} GB" for op, b in self.communication.items()]
            lines += [f"  over {link}: {b / 1e9:.4g} GB" for link, b in self.link_bytes.items()]
            lines.append(
                f"communication at peak link rates: {self.communication_seconds() * 1e3:.4g} ms"
            )
            lines.append(
                f"estimate at H100 peaks: {self.estimate_seconds() * 1e3:.4g} ms with no overlap, "
                f"{self.estimate_seconds(overlap=True) * 1e3:.4g} ms with collectives overlapped"
            )
        else:
            lines.append(f"estimate at H100 peaks: {self.estimate_seconds() * 1e3:.4g} ms")
        if self.unknown_trip_counts:
            lines.append(f"loops counted once: {', '.join(self.unknown_trip_counts)}")
        return "\n".join(lines)


def total(kernels: Iterable[KernelCost | CollectiveCost], unknown: tuple[str, ...] = ()) -> Cost:
    """The `Cost` of `kernels` (collectives among them): their FLOPs by GEMM kind, bytes by
    category and bytes sent by collective and by link, times runs."""
    flops: dict[str, int] = {}
    traffic: dict[str, int] = {}
    communication: dict[str, int] = {}
    links: dict[str, int] = {}
    kernels = tuple(kernels)
    collectives = tuple(k for k in kernels if isinstance(k, CollectiveCost))
    others = tuple(k for k in kernels if isinstance(k, KernelCost))
    for k in others:
        if k.kind is not None:
            flops[k.kind] = flops.get(k.kind, 0) + k.flops * k.runs
        if k.category is not None:
            traffic[k.category] = traffic.get(k.category, 0) + k.bytes * k.runs
    for c in collectives:
        communication[c.op] = communication.get(c.op, 0) + c.wire_bytes * c.runs
        links[c.link] = links.get(c.link, 0) + c.wire_bytes * c.runs
    return Cost(flops, traffic, unknown, others, communication, links, collectives)
