"""Section 4: the Llama-3-style block of `benchmarks/llama_block.py`, timed on the GPU, BF16
against delayed scaling (with its warm start, the default; without it, `delayed-cold`; with
it behind a conditional, `delayed-cond`) and current scaling (the full run).

Blocks (`llama_block.SHAPES`): "8B" (Llama-3-8B's: width 4096, 32 heads of 128, SwiGLU 14336,
2 x 4096 tokens) and "1B" (Llama-3.2-1B's: width 2048, 32 heads of 64, SwiGLU 8192,
4 x 2048 tokens); the quick run takes "1B" alone, the dry run the tiny "dry" block. The step
is `llama_block.step()` (value and gradient over float32 masters cast to BF16 and over the
input, SGD), compiled once with `fp8jax.gpu_compiler_options()` and timed as every step of
the check is (`timing.compile_and_time`: median of warm runs); each variant is given as a
ratio to the BF16 step of the same size measured in the same run. That is one step at a
time, each waited for (as the measurements of issue 38 timed it), so the host's time to
launch a step counts: in run 6 the steps took 0.6-2.7 ms longer than their kernels' span on
the device. Beside it, `ms_pipelined`: `PIPELINED` steps launched back to back per run, as a
training loop that does not wait for each step's result runs them, so that the host's
launch overlaps the previous step (and its ratio to BF16's, `vs_bf16_pipelined`). And the
host's time for a call by arrays in and out (`dispatch`: a program of tiny arrays, as many
as BF16's step takes, as FP8's, and more), to tell what FP8's state arrays cost it. Beside the
time, the
compiled step's HLO read as `llama_block.py` reads a deviceless compile
(`llama_block.split`): kernels per step by kind, the HBM bytes of the non-GEMM kernels
(attention's left out), temp memory and the cost model's estimate (`fp8jax.hlo_cost` of the
GPU's own HLO), to be kept honest against the measured time and the profile.

Delayed scaling's variants are timed with the states a training run has after its first
steps (`llama_block.recorded_states`: two warm steps of `delayed` on the same input), not
a fresh model's: before session 41 they were, and a fresh state casts with 1.0 without the
warm start (this loss's output gradients, under 1e-6, flush to zero in E5M2, and every
dgrad behind them: `delayed-cold`'s GEMMs multiplied zeros in runs 4-6) and with 0 where the
warm start is skipped (every operand zero). A name ending in `-fresh` keeps the fresh
states, to time that difference (`delayed-cold` / `delayed-cold-fresh` among `CANDIDATES`).

Attention is cuDNN's flash attention on a GPU (`implementation="cudnn"`), XLA's in the dry
run. Where a cuDNN step fails to compile or run, its error is recorded and that size goes on
with XLA's attention (BF16 measured again with it, so that ratios compare like with like),
the cell saying so.

The compiled steps are kept (`Prepared`) for section 5 (`profile.py`), which traces them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
import llama_block

import fp8jax

from .record import Recorder
from .timing import Compiled, compile_and_time, time_calls

SECTION = "4 Llama block"
#: Steps launched back to back per run for `ms_pipelined`.
PIPELINED = 4
CUBLAS = fp8jax.gpu_compiler_options()
#: mode -> the block sizes of `llama_block.SHAPES` it runs.
SIZES = {"full": ["8B", "1B"], "quick": ["1B"], "dry": ["dry"]}
#: mode -> variants (`llama_block.variant` names), BF16 first: the others' reference.
VARIANTS = {
    "full": ["bf16", "delayed", "delayed-cold", "delayed-cond", "current"],
    "quick": ["bf16", "delayed", "delayed-cold", "delayed-cond"],
    "dry": ["bf16", "delayed"],  # a CPU compile of the step takes about 10 s
}
#: Seconds of the budget one compile and timing of a size's step may need on a GPU.
NEED_S = {"8B": 60.0, "1B": 40.0, "dry": 0.0}


def variant_names(mode: str, variants: list[str] | None) -> list[str]:
    """The variants to run: `variants` (from `--llama-variants`) with BF16 first, or the
    mode's own (`VARIANTS`)."""
    if variants is None:
        return VARIANTS[mode]
    return ["bf16", *(v for v in variants if v != "bf16")]


def attentions(mode: str) -> list[str]:
    """Attention implementations to try, in order: cuDNN's then XLA's on a GPU."""
    return ["xla"] if mode == "dry" else ["cudnn", "xla"]


@dataclasses.dataclass
class Prepared:
    """A variant's step compiled for its arguments (`timing.Compiled`), and its attention."""

    compiled: Compiled
    attention: str


#: (size, variant) -> its prepared step: what section 4 compiled, for section 5.
Cache = dict[tuple[str, str], Prepared]


def shape_text(size: str) -> str:
    s = llama_block.SHAPES[size]
    return (
        f"width {s['width']}, {s['heads']} heads, SwiGLU {s['ffn']}, "
        f"{s['batch']} x {s['context']} tokens"
    )


def prepare(size: str, name: str, attention: str, runs: int) -> tuple[Compiled, dict[str, Any]]:
    """Variant `name` of block `size` with `attention`: compiled with the cuBLAS options and
    timed (`runs` runs; 0: compiled and called once, not timed)."""
    args = llama_block.arguments(size, name, attention, abstract=False)
    fn = llama_block.step(name)
    compiled, fields = compile_and_time(fn, args, CUBLAS, max(runs, 1), dry=False)
    if runs == 0:
        fields = {"compile_s": fields["compile_s"]}
    else:
        fields["ms_pipelined"] = time_calls(compiled, runs, PIPELINED)["ms"]
    fields["attention"] = attention
    return compiled, fields


def hlo_fields(compiled: Compiled) -> dict[str, Any]:
    """`llama_block.split` of a compiled step, as result fields."""
    s = llama_block.split(compiled.executable)
    return {
        "kernels": s.kernel_count,
        "kernels_by_kind": s.kernels,
        "non_gemm_bytes": s.non_gemm_bytes,
        "gemm_flops": s.gemm_flops,
        "temp_bytes": s.temp_bytes,
        "estimate_ms": s.estimate_s * 1e3,
    }


def other_bytes(fields: dict[str, Any]) -> int:
    """Non-GEMM HBM bytes of a step, attention's left out: on a GPU it is cuDNN's flash
    attention, the same work in every variant, not FP8's. (`llama_block.table` counts every
    non-GEMM kernel: its attention is a stand-in that XLA fuses into FP8's casts.)"""
    return sum(v for k, v in fields["non_gemm_bytes"].items() if k != "attention")


def ratios(fields: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """The ratios of a variant's fields to BF16's of the same size and attention."""
    out = {"vs_bf16": fields["ms"] / base["ms"]}
    if "ms_pipelined" in fields and "ms_pipelined" in base:
        out["vs_bf16_pipelined"] = fields["ms_pipelined"] / base["ms_pipelined"]
    out["kernels_vs_bf16"] = fields["kernels"] / base["kernels"]
    if other_bytes(base):
        out["non_gemm_bytes_vs_bf16"] = other_bytes(fields) / other_bytes(base)
    if base["temp_bytes"]:
        out["temp_vs_bf16"] = fields["temp_bytes"] / base["temp_bytes"]
    if base["estimate_ms"]:
        out["estimate_vs_bf16"] = fields["estimate_ms"] / base["estimate_ms"]
    return out


def _measure(size: str, name: str, attention: str, seen: dict, runs: int, cache: Cache) -> dict:
    compiled, fields = prepare(size, name, attention, runs)
    fields.update(hlo_fields(compiled))
    base = seen.get((attention, "bf16"))
    if base is not None and name != "bf16":
        fields.update(ratios(fields, base))
    seen[(attention, name)] = fields
    cache[(size, name)] = Prepared(compiled, attention)
    return fields


def _cells(rec: Recorder, size: str, name: str, fields: dict[str, Any], note: str) -> None:
    def times(key: str) -> str:
        return f" ({fields[key]:.2f}x)" if key in fields else ""

    step = f"{fields['ms']:.3f} ms"
    if "vs_bf16" in fields:
        step += f", {fields['vs_bf16']:.3f}x"
    if "ms_pipelined" in fields:
        step += f"; pipelined {fields['ms_pipelined']:.3f} ms"
        if "vs_bf16_pipelined" in fields:
            step += f", {fields['vs_bf16_pipelined']:.3f}x"
    hlo = (
        f"{fields['kernels']} kernels{times('kernels_vs_bf16')}, non-GEMM "
        f"{other_bytes(fields) / 1e9:.3g} GB{times('non_gemm_bytes_vs_bf16')}, temp "
        f"{fields['temp_bytes'] / 2**30:.3g} GiB{times('temp_vs_bf16')}, cost model ESTIMATE "
        f"{fields['estimate_ms']:.3g} ms{times('estimate_vs_bf16')}"
    )
    rec.cell(SECTION, name, f"{size} step", step + note)
    rec.cell(SECTION, name, f"{size} compiled HLO", hlo)


def run(
    rec: Recorder,
    mode: str,
    runs: int,
    cache: Cache | None = None,
    variants: list[str] | None = None,
) -> dict[str, dict]:
    """Time every size's variants (`variants`, default `VARIANTS[mode]`; BF16 is always
    first); returns `{size: {variant: fields}}` and fills `cache` with the compiled steps."""
    cache = {} if cache is None else cache
    names = variant_names(mode, variants)
    results: dict[str, dict] = {}
    for size in SIZES[mode]:
        order = attentions(mode)
        attention, note = order[0], ""
        seen: dict[tuple[str, str], dict] = {}
        rec.cell(SECTION, "block", f"{size} step", shape_text(size))
        rec.cell(SECTION, "attention", f"{size} step", attention)
        for name in names:
            while True:
                if name != "bf16" and attention != order[0] and (attention, "bf16") not in seen:
                    _reference(rec, size, attention, seen, runs, cache, note)  # like with like
                fields = _one(rec, size, name, attention, seen, runs, cache)
                if fields is None and rec.last_status == "error" and attention != order[-1]:
                    failed, attention = attention, order[order.index(attention) + 1]
                    note = f" ({attention} attention: {failed} failed)"
                    rec.cell(SECTION, "attention", f"{size} step", f"{attention} ({failed} failed)")
                    rec.log(f"{SECTION}: {size}: {failed} attention failed, {attention} from now")
                    continue
                break
            if fields is None:
                rec.cell(SECTION, name, f"{size} step", rec.not_run())
                continue
            results.setdefault(size, {})[name] = fields
            _cells(rec, size, name, fields, note)
    probe = rec.measure(SECTION, "host dispatch", functools.partial(dispatch, mode), need_s=10)
    if probe is not None:
        rec.cell(SECTION, "host dispatch", f"{SIZES[mode][0]} step", dispatch_text(probe))
    return results


#: Arrays in and out of the dispatch probe: as many as BF16's Llama step takes (10 in, 11
#: out), FP8's (73, 74: 21 states of three arrays more), and more.
DISPATCH_ARRAYS = (10, 74, 200)


def dispatch(mode: str) -> dict[str, Any]:
    """The host's time for a call of a program of `n` tiny arrays in and out (`x + 1` each),
    for each `n` of `DISPATCH_ARRAYS`: one call at a time and waited for (`us_{n}`), and
    `PIPELINED` back to back (`us_{n}_pipelined`), in microseconds. What a step's many FP8
    state arrays cost the host: in run 6 the FP8 Llama-1B step took 1.08 ms longer than its
    kernels' span on the device, BF16's 0.58 ms."""
    fields: dict[str, Any] = {}
    runs = 5 if mode == "dry" else 50
    for n in DISPATCH_ARRAYS:
        xs = tuple(jnp.full((4,), i, jnp.float32) for i in range(n))
        compiled = Compiled(lambda *a: [x + 1 for x in a], xs, None, dry=False)
        compiled.run()
        fields[f"us_{n}"] = time_calls(compiled, runs, 1)["ms"] * 1e3
        fields[f"us_{n}_pipelined"] = time_calls(compiled, runs, PIPELINED)["ms"] * 1e3
    return fields


def dispatch_text(fields: dict[str, Any]) -> str:
    """The dispatch probe's cell: microseconds per call by arrays in and out."""
    arrays = " / ".join(str(n) for n in DISPATCH_ARRAYS)
    synced = " / ".join(f"{fields[f'us_{n}']:.0f}" for n in DISPATCH_ARRAYS)
    piped = " / ".join(f"{fields[f'us_{n}_pipelined']:.0f}" for n in DISPATCH_ARRAYS)
    return f"{arrays} arrays in and out: {synced} us a call, waited for; {piped} us pipelined"


#: (default, candidate) pairs of variants whose time ratio would decide a default.
CANDIDATES = (
    ("delayed-steady", "delayed-steady-apart"),
    ("delayed-steady", "delayed-steady-apart-acts"),
    ("delayed-steady", "delayed-steady-fused"),
    ("delayed-steady", "delayed-steady-words"),
    ("delayed-steady-apart", "delayed-steady-apart-words"),
    ("delayed-steady", "delayed-steady-packed"),
    ("delayed-steady-apart", "delayed-steady-apart-packed"),
    ("delayed-steady", "delayed-steady-kernel"),
    ("delayed-steady", "delayed-steady-kernel-grads"),
    ("delayed-steady", "delayed-steady-tc"),
    ("delayed-steady", "delayed-steady-tc-grads"),
    ("delayed-steady-apart", "delayed-steady-apart-tc-grads"),
    ("delayed-steady-apart", "delayed-steady-kernel-grads"),
    ("delayed-steady-apart", "delayed-steady-apart-kernel-grads"),
    ("delayed", "delayed-apart"),
    ("delayed-cold", "delayed-cold-fresh"),
    ("current", "current-apart"),
    ("current", "current-kernel"),
    ("current", "current-kernel-grads"),
    ("current", "current-tc"),
    ("blockwise", "blockwise-pairs"),
    ("blockwise", "blockwise-tile-scales"),
    ("blockwise", "blockwise-chained"),
    ("blockwise", "blockwise-slabs"),
    ("blockwise", "blockwise-tc"),
)


def decide(rec: Recorder, results: dict[str, dict]) -> None:
    """Decision inputs: each candidate's time against its default's, one step at a time and
    pipelined (> 1: the candidate is faster), where both ran with the same attention."""
    for size, fields in results.items():
        for default, candidate in CANDIDATES:
            a, b = fields.get(default), fields.get(candidate)
            if not a or not b or a["attention"] != b["attention"]:
                continue
            text = (
                f"Llama {size} block: {default} / {candidate}: time ratio {a['ms'] / b['ms']:.3f}"
            )
            if "ms_pipelined" in a and "ms_pipelined" in b:
                text += f", pipelined {a['ms_pipelined'] / b['ms_pipelined']:.3f}"
            rec.decision(text + " (> 1: the second is faster)")


def _one(
    rec: Recorder, size: str, name: str, attention: str, seen: dict, runs: int, cache: Cache
) -> dict | None:
    measure = functools.partial(_measure, size, name, attention, seen, runs, cache)
    fields = rec.measure(SECTION, f"{size} | {name} | {attention}", measure, need_s=NEED_S[size])
    if fields is not None:  # (also where recorded by an earlier process: `Recorder.measure`)
        seen[(attention, name)] = fields
    return fields


def _reference(
    rec: Recorder, size: str, attention: str, seen: dict, runs: int, cache: Cache, note: str
) -> None:
    """BF16 again with the fallback attention, the reference of the variants after it."""
    fields = _one(rec, size, "bf16", attention, seen, runs, cache)
    if fields is not None:
        _cells(rec, size, "bf16", fields, note)
