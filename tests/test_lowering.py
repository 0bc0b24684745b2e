"""The jitted train step lowers with every forward, dgrad and wgrad dot taking FP8 operands."""

import re
from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import h100_topology, make_train_step

import fp8jax
from fp8jax._src.kernels import CAST_TRANSPOSE_NAME
from fp8jax._src.recipes import ROLES


def dot_operand_types(stablehlo: str) -> list[tuple[str, str]]:
    """The element types of the two operands of every `stablehlo.dot_general`."""
    tensor = r"tensor<(?:\d+x)*(\w+)>"
    pattern = re.compile(rf"stablehlo\.dot_general .*: \({tensor}, {tensor}\)")
    lines = [line for line in stablehlo.splitlines() if "stablehlo.dot_general" in line]
    types = [pattern.search(line).groups() for line in lines]
    assert len(types) == len(lines)
    return types


class GatedMLP(eqx.Module):
    """A learned input gain (high precision) in front of two FP8 layers: the gain's gradient
    needs fc1's dgrad, so all three GEMMs of both layers appear."""

    gain: jax.Array
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x * self.gain)))


def lower_train_step(model, x, y, vmapped):
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))

    def loss_fn(model, x, y):
        pred = jax.vmap(model)(x) if vmapped else model(x)
        return jnp.mean((pred - y) ** 2)

    step = eqx.filter_jit(make_train_step(loss_fn, optimizer))
    return step.lower(model, opt_state, x, y).as_text()


@pytest.mark.parametrize("vmapped", [False, True], ids=["batched-call", "vmap"])
def test_train_step_has_six_fp8_gemms(getkey, vmapped):
    k1, k2 = jax.random.split(getkey())
    model = GatedMLP(jnp.ones(16), eqx.nn.Linear(16, 64, key=k1), eqx.nn.Linear(64, 16, key=k2))
    model = fp8jax.fp8_linear_layers(model)
    x = jnp.ones((128, 16))
    text = lower_train_step(model, x, x, vmapped)
    types = dot_operand_types(text)
    # Every wgrad contracts over the 128 tokens: no per-example outer products under vmap.
    assert "contracting_dims = [] x []" not in text
    forward = [t for t in types if t == ("f8E4M3FN", "f8E4M3FN")]
    backward = [t for t in types if t[0] == "f8E5M2" and t[1] == "f8E4M3FN"]
    assert len(forward) == 2 and len(backward) == 4, types  # 2 x (fwd, dgrad, wgrad)
    assert len(types) == 6, types


def test_high_precision_model_has_no_fp8_dots(getkey):
    k1, k2 = jax.random.split(getkey())
    model = GatedMLP(jnp.ones(16), eqx.nn.Linear(16, 64, key=k1), eqx.nn.Linear(64, 16, key=k2))
    x = jnp.ones((128, 16))
    types = dot_operand_types(lower_train_step(model, x, x, vmapped=True))
    assert len(types) == 6 and all(t == ("f32", "f32") for t in types), types


RECIPES = {
    "delayed": fp8jax.DelayedScaling(),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(block_size=32),
    "mxfp8": fp8jax.MXFP8(),
    "residual": fp8jax.ResidualFP8(split_activation=True, error_feedback=True),
}
E4, E5 = "f8E4M3FN", "f8E5M2"
# The dots of the two layers' fwd, dgrad and wgrad, by operand types. Per-tensor recipes take
# the output gradient in E5M2; block recipes in E4M3, one dot per GEMM (over a batch of
# blocks, or one chunk of the contraction at a time). The residual recipe (E4M3 gradients)
# with a split activation runs per layer 3 forward dots (x_hi W_hi, x_hi W_lo, x_lo W_hi),
# 2 dgrad (g W_hi, g W_lo) and 2 wgrad (g x_hi, g x_lo).
DOTS = {
    "delayed": {(E4, E4): 2 * 1, (E5, E4): 2 * (1 + 1)},
    "current": {(E4, E4): 2 * 1, (E5, E4): 2 * (1 + 1)},
    "blockwise": {(E4, E4): 2 * (1 + 1 + 1)},
    "mxfp8": {(E4, E4): 2 * (1 + 1 + 1)},
    "residual": {(E4, E4): 2 * (3 + 2 + 2)},
}


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_lowers_to_fp8_gemms_only(getkey, name):
    k1, k2 = jax.random.split(getkey())
    model = GatedMLP(jnp.ones(64), eqx.nn.Linear(64, 96, key=k1), eqx.nn.Linear(96, 64, key=k2))
    model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=RECIPES[name]))
    x = jnp.ones((128, 64))
    text = lower_train_step(model, x, x, vmapped=True)
    types = dot_operand_types(text)
    assert Counter(types) == DOTS[name], types
    assert "contracting_dims = [] x []" not in text


def test_no_float32_copy_of_a_bf16_activation_on_h100():
    """XLA's GPU compiler drops a float32 -> BF16 -> float32 pair of converts. A BF16
    LayerNorm output that fp8jax widened back to float32 for its cast was then read as its
    float32 producer: a float32 intermediate the BF16 program does not have. Compiled for an
    H100, no float32 array of the activation's shape may remain."""
    from fp8jax._src.core.formats import saturate

    topology = h100_topology()

    def norm_then_cast(x, scale):
        x32 = x.astype(jnp.float32)
        y = (x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + 1)
        y = y.astype(jnp.bfloat16)  # a BF16 activation with two consumers
        return saturate(y, scale, jnp.float8_e4m3fn), jnp.tanh(y)

    sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])
    args = (
        jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding),
    )
    text = jax.jit(norm_then_cast).lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    assert "f32[1024,512]" not in entry, [s for s in entry.splitlines() if "f32[1024,512]" in s]


def test_only_per_tensor_recipes_save_transposed_copies():
    flipped = {name for name, recipe in RECIPES.items() if recipe.transposed_copies}
    assert flipped == {"delayed", "current"}


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_per_tensor_backward_gemms_need_no_transpose_kernel_on_h100(getkey, name):
    """cuBLASLt's FP8 GEMM takes both operands K-major: the dgrad needs the kernel and the
    wgrad the activation and the output gradient transposed. Per-tensor recipes have the
    kernels that quantize them write those copies too (`transposed_copies`): the compiled
    train step of a two-layer MLP (cuBLAS mode) runs no kernel of its own to transpose an
    FP8 operand, where each layer's backward had one per operand."""
    from fp8jax.examples.gpt import MLP

    # At these sizes XLA's fusion heuristics take each copy into its quantizing kernel; at a
    # width of 1024 it fuses fc2's output gradient with its bias gradient's reduction
    # instead, and transposes that one copy in a kernel of its own.
    config = fp8jax.Fp8Config(recipe=RECIPES[name])
    mlp = fp8jax.fp8_linear_layers(MLP(2048, 1, False, key=getkey()), config)
    x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)

    def step(model, x):
        return fp8jax.filter_grad(lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2))(model, x)

    report = fp8jax.inspect(step, mlp, x, modes=("cublas",))
    gemms = report.gemms["cublas"]
    want = [("fc1", "fwd"), ("fc1", "wgrad"), ("fc2", "dgrad"), ("fc2", "fwd"), ("fc2", "wgrad")]
    assert sorted((g.layer, g.role) for g in gemms if g.fp8) == want  # x needs no gradient
    kernels = report.cost["cublas"].kernels
    transposes = [  # in an FP8 layer's scope, but the amax histories' concatenations
        k.name
        for k in kernels
        if k.category == "transpose/copy"
        and "fp8jax[" in k.op_name
        and not k.op_name.endswith("concatenate")
    ]
    assert not transposes, transposes
    # Their copies come out of the quantizing kernels: one writes an operand in both layouts.
    assert any("convert" in k.name and "transpose" in k.name for k in kernels), [
        k.name for k in kernels
    ]


def test_kept_inverses_cost_no_kernel_in_cublas_mode(getkey):
    """Without the warm start, delayed scaling's scales and their inverses are the state's
    own. Traced for a compile with Triton GEMMs off (`cublas_traced`, as
    `fp8jax.make_train_step` traces), each GEMM takes the two inverses on its operands, which
    XLA makes cuBLASLt's own scales: a step of an MLP with its merge (cuBLAS mode) runs one
    kernel fewer per FP8 GEMM than with their product as one factor, the same GEMMs in FP8."""
    from fp8jax._src.core.compile_options import cublas_traced
    from fp8jax.examples.gpt import MLP

    config = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(warm_start=False))
    mlp = fp8jax.fp8_linear_layers(MLP(512, 1, False, key=getkey()), config)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)

    def step(model, x):
        grads = fp8jax.filter_grad(lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2))(model, x)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        return fp8jax.apply_updates(model, grads, overwrites)

    def for_cublas(model, x):
        with cublas_traced():
            return step(model, x)

    reports = [fp8jax.inspect(f, mlp, x, modes=("cublas",)) for f in (step, for_cublas)]
    gemms = [[(g.layer, g.role, g.fp8) for g in r.gemms["cublas"]] for r in reports]
    assert gemms[0] == gemms[1] and len(gemms[0]) == 5 and all(g[2] for g in gemms[0])
    kernels = [r.cost["cublas"].kernels for r in reports]
    assert len(kernels[1]) == len(kernels[0]) - 5, [[k.name for k in ks] for ks in kernels]
    # The kernels gone are the factors: a product of two float32 scalars each.
    scalars = [[k.name for k in ks if k.category is not None and k.bytes == 12] for ks in kernels]
    assert len(scalars[0]) == 5 and not scalars[1], scalars


class Twice(eqx.Module):
    """One FP8 layer called on two inputs (a shared layer), behind a learned gain so that
    its dgrads run too: its two forwards and its two dgrads share the weight's FP8 copy."""

    gain: jax.Array
    fc: eqx.nn.Linear

    def __call__(self, a, b):
        ya, yb = (jax.vmap(self.fc)(x * self.gain) for x in (a, b))
        return jnp.mean(ya.astype(jnp.float32) * yb.astype(jnp.float32))


def shared_weight_step(case, key, recipe=None, steady=True):
    """A model, its input and the step (gradient and merge, as the train steps' program once
    every scale is recorded, or with `steady=False` their first) of a `case` whose GEMMs
    share an FP8 weight: `Twice`, or an MLP through `accumulate_gradients` over 2
    microbatches (XLA unrolls so short a scan: each weight's FP8 copy is one for both), every
    Linear `recipe` (delayed scaling by default), and the number of GEMMs the step runs.
    Also benchmarks/shared_operands.py's."""
    import contextlib

    from fp8jax._src.recipes.per_tensor import skip_warm_start
    from fp8jax.examples.gpt import MLP

    config = fp8jax.Fp8Config(recipe=recipe or fp8jax.DelayedScaling(), exclude=None)
    if case == "layer-called-twice":
        fc = eqx.nn.Linear(512, 512, use_bias=False, key=key, dtype=jnp.bfloat16)
        model = fp8jax.fp8_linear_layers(Twice(jnp.ones(512, jnp.bfloat16), fc), config)
        x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
        grad, args, gemms = fp8jax.filter_grad(lambda m, a, b: m(a, b)), (x, x), 6
    else:  # 2 x (2 fwd, 2 wgrad, fc2's dgrad)
        model = fp8jax.fp8_linear_layers(MLP(512, 1, False, key=key), config)
        loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
        grad = lambda m, x: fp8jax.accumulate_gradients(loss, 2)(m, x)[1]  # noqa: E731
        args, gemms = (jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16),), 10

    def step(model, *args):
        with skip_warm_start(recorded=True) if steady else contextlib.nullcontext():
            overwrites, grads = fp8jax.partition_for_grad_overwrite(grad(model, *args))
            return fp8jax.apply_updates(model, grads, overwrites)

    return model, args, step, gemms


@pytest.mark.parametrize("case", ["layer-called-twice", "microbatches"])
def test_gemms_sharing_a_weight_stay_fp8_in_the_steady_train_step_on_h100(getkey, case):
    """XLA's dot merger joins dots that share an operand into one dot over the others
    concatenated. In the train step's program once every scale is recorded (traced for
    cuBLAS: each GEMM carries its operands' kept inverses) a layer called twice, or every
    layer of a step over microbatches, shares its weight's FP8 copy between GEMMs, and the
    merged GEMMs ran in BF16 (JAX 0.10.2 to 0.12). The train steps compile such programs
    with the merger off (`traced_options`): every GEMM FP8 (cuBLAS mode, deviceless H100)."""
    from fp8jax._src.core.compile_options import traced_for, traced_options

    model, args, step, count = shared_weight_step(case, getkey())
    options = fp8jax.gpu_compiler_options()
    gemms = {
        name: fp8jax.inspect(
            traced_for(options, step), model, *args, modes=("cublas",), compiler_options=o
        ).gemms["cublas"]
        for name, o in (("merger", options), ("train step", traced_options(options)))
    }
    fp8 = {name: [g.fp8 for g in gs] for name, gs in gemms.items()}
    assert fp8["train step"] == [True] * count, gemms["train step"]
    # What the merger did: fewer GEMMs, some not FP8 (so the check above can fail).
    assert len(fp8["merger"]) < count and not all(fp8["merger"]), gemms["merger"]


def _steady_mlp_step(roles, setting=None):
    """A train step of an FP8 MLP with its merge as `fp8jax.make_train_step` runs it once every
    scale is recorded (traced for cuBLAS, without the warm start), inside `setting(roles)`
    (`transposes_apart` by default) unless `roles` is None."""
    import contextlib

    from fp8jax._src.core.compile_options import cublas_traced
    from fp8jax._src.recipes.per_tensor import skip_warm_start, transposes_apart

    setting = setting or transposes_apart

    def step(model, x):
        with (
            cublas_traced(),
            skip_warm_start(recorded=True),
            contextlib.nullcontext() if roles is None else setting(roles),
        ):
            loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
            grads = fp8jax.filter_grad(loss)(model, x)
            overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
            return fp8jax.apply_updates(model, grads, overwrites)

    return step


def _steady_mlp_reports(getkey, roles, name, setting=None):
    """`fp8jax.inspect` reports (cuBLAS mode, deviceless H100) of a delayed-scaling MLP's
    steady-state step (`_steady_mlp_step`) with every transposed copy written by the cast
    (`"fused"`: `transposes_apart(())`) and inside `setting(roles)` (`name`; `roles=None`:
    as `fp8jax.make_train_step` traces it)."""
    from fp8jax.examples.gpt import MLP

    if h100_topology() is None:
        pytest.skip("needs the CUDA plugin (the h100 extra)")
    config = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling())
    mlp = fp8jax.fp8_linear_layers(MLP(2048, 1, False, key=getkey()), config)
    x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
    from fp8jax._src.recipes.per_tensor import transposes_apart

    steps = {
        "fused": _steady_mlp_step((), transposes_apart),
        name: _steady_mlp_step(roles, setting),
    }
    return {key: fp8jax.inspect(f, mlp, x, modes=("cublas",)) for key, f in steps.items()}


@pytest.mark.parametrize(
    "roles, apart, bytes_ratio",
    [
        # fc1's input, fc2's input and kernel (fc1's dgrad is not needed), both gradients
        (("input", "kernel", "output_grad"), 5, 0.9),
        (("input", "output_grad"), 4, 0.9),
        # the default: fc1's and fc2's output gradients (`KNOWN_SCALE_APART`), read once less
        (None, 2, 0.96),
    ],
    ids=["every-operand", "activations-and-gradients", "default-gradients"],
)
def test_transposes_apart_let_the_cast_reduce_the_amax_on_h100(getkey, roles, apart, bytes_ratio):
    """Issue 38: inside `transposes_apart(roles)` the transposed FP8 copies of those operands
    are transposed from the FP8 values by kernels of their own, and the kernels that cast
    the operands reduce their amaxes too (XLA fuses no reduction into a transposing kernel):
    a steady-state MLP step (cuBLAS mode, deviceless H100) reads fewer operands again for
    their amaxes (none with every operand's copy apart), moves fewer non-GEMM bytes, and
    runs the same FP8 GEMMs, than where the casts write both layouts and the amaxes are
    reduced apart (`transposes_apart(())`). The step as traced by default makes the output
    gradients' copies apart (session 42)."""
    reports = _steady_mlp_reports(getkey, roles, "apart")
    gemms = {k: [(g.layer, g.role, g.fp8) for g in r.gemms["cublas"]] for k, r in reports.items()}
    assert gemms["apart"] == gemms["fused"] and len(gemms["apart"]) == 5
    assert all(fp8 for *_, fp8 in gemms["apart"])
    kernels = {k: r.cost["cublas"].kernels for k, r in reports.items()}

    def fp8_transposes(ks):  # FP8 operands transposed by a kernel of its own
        return [
            k.name
            for k in ks
            if k.category == "transpose/copy" and "optimization_barrier" in k.op_name
        ]

    def operand_amaxes(ks):  # amaxes reduced by a kernel reading a whole operand (> 1 MB)
        return [k.name for k in ks if k.category == "amax" and k.bytes > 2**20]

    def casts_reducing(ks):
        return [k.name for k in ks if k.category == "quantize" and "reduce" in k.name]

    names = [k.name for k in kernels["apart"]]
    assert not fp8_transposes(kernels["fused"])
    assert len(fp8_transposes(kernels["apart"])) == apart, names
    assert len(casts_reducing(kernels["apart"])) >= 2, names
    assert len(operand_amaxes(kernels["fused"])) >= 3
    assert len(operand_amaxes(kernels["apart"])) < len(operand_amaxes(kernels["fused"]))
    if "kernel" in (roles or ()):
        assert not operand_amaxes(kernels["apart"]), names
    moved = {k: sum(c.bytes for c in ks if c.category is not None) for k, ks in kernels.items()}
    assert moved["apart"] < bytes_ratio * moved["fused"], moved


def test_transposes_in_words_write_the_same_kernels_in_words_on_h100(getkey):
    """Inside `transposes_in_words()` the copies a steady-state MLP step makes apart (the
    output gradients', by default) are transposed as 32-bit words: the same FP8 GEMMs, the
    same number of kernels and the same non-GEMM bytes as without it (cuBLAS mode,
    deviceless H100), and no FP8 transpose of bytes left."""
    from fp8jax._src.recipes.per_tensor import transposes_in_words

    reports = {
        "words": _steady_mlp_reports(getkey, (), "words", lambda _: transposes_in_words())["words"],
        "default": _steady_mlp_reports(getkey, None, "default")["default"],
    }
    gemms = {k: [(g.layer, g.role, g.fp8) for g in r.gemms["cublas"]] for k, r in reports.items()}
    assert gemms["words"] == gemms["default"] and all(fp8 for *_, fp8 in gemms["words"])
    kernels = {k: r.cost["cublas"].kernels for k, r in reports.items()}
    assert len(kernels["words"]) == len(kernels["default"])
    moved = {k: sum(c.bytes for c in ks if c.category is not None) for k, ks in kernels.items()}
    assert moved["words"] == moved["default"], moved
    # XLA's FP8 transposes (of the barrier's bytes) are gone: the words' kernels replace them.
    byte_transposes = {
        k: [
            c.name
            for c in ks
            if c.category == "transpose/copy" and "optimization_barrier" in c.op_name
        ]
        for k, ks in kernels.items()
    }
    assert len(byte_transposes["default"]) == 2 and not byte_transposes["words"], byte_transposes


@pytest.mark.parametrize(
    "roles, calls",
    [(("input", "kernel", "output_grad"), 6), (("output_grad",), 2)],
    ids=["every-operand", "gradients"],
)
def test_cast_transpose_kernel_quantizes_each_operand_in_one_pass_on_h100(getkey, roles, calls):
    """Issue 38: inside `cast_transpose_kernel(roles)` a steady-state MLP step (cuBLAS mode,
    deviceless H100) quantizes each operand of `roles` (fc1's and fc2's) with the one-pass
    kernel, whose copies the same FP8 GEMMs take: no FP8 operand transposed by a kernel of
    its own, fewer operands read again for their amaxes (none with every operand's), and
    fewer of XLA's quantizing fusions."""
    from fp8jax._src.recipes.per_tensor_pass import cast_transpose_kernel

    reports = _steady_mlp_reports(getkey, roles, "kernel", cast_transpose_kernel)
    gemms = {
        k: sorted((g.layer, g.role, g.fp8) for g in r.gemms["cublas"]) for k, r in reports.items()
    }
    assert gemms["kernel"] == gemms["fused"] and len(gemms["kernel"]) == 5  # in any order
    kernels = {k: r.cost["cublas"].kernels for k, r in reports.items()}
    names = [k.name for k in kernels["kernel"]]
    ours = [k for k in kernels["kernel"] if CAST_TRANSPOSE_NAME in k.op_name]
    assert len(ours) == calls and all(k.category == "quantize" for k in ours), names

    def xla_casts(ks):
        return [k for k in ks if k.category == "quantize" and CAST_TRANSPOSE_NAME not in k.op_name]

    def operand_amaxes(ks):  # amaxes reduced by a kernel reading a whole operand (> 1 MB)
        return [k.name for k in ks if k.category == "amax" and k.bytes > 2**20]

    assert not [k for k in kernels["kernel"] if k.category == "transpose/copy"], names
    assert len(xla_casts(kernels["kernel"])) < len(xla_casts(kernels["fused"]))
    assert len(operand_amaxes(kernels["kernel"])) < len(operand_amaxes(kernels["fused"]))
    if "kernel" in roles:
        assert not operand_amaxes(kernels["kernel"]) and not xla_casts(kernels["kernel"]), names


def test_transposes_apart_takes_roles():
    from fp8jax._src.recipes.per_tensor import (
        skip_warm_start,
        transposes_apart,
        transposes_apart_chosen,
        transposes_apart_set,
    )

    with transposes_apart(["kernel"]):
        assert transposes_apart_chosen("kernel") and not transposes_apart_chosen("input")
        assert not fp8jax.DelayedScaling().transposes_apart("output_grad")
        assert not fp8jax.DelayedScaling(warm_start=False).transposes_apart("output_grad")
        assert fp8jax.CurrentScaling().transposes_apart("kernel")
        assert not fp8jax.BlockwiseScaling().transposes_apart("kernel")  # no transposed copies
    with transposes_apart("output_grad"):  # one role
        assert transposes_apart_chosen("output_grad") and not transposes_apart_chosen("kernel")
    with transposes_apart(()), skip_warm_start(recorded=True):  # none, the default set aside
        assert transposes_apart_set() and not any(map(transposes_apart_chosen, ROLES))
        assert not any(map(fp8jax.DelayedScaling().transposes_apart, ROLES))
    assert not transposes_apart_chosen("kernel") and not transposes_apart_set()
    for bad in (("weights",), "weights", ("input", "weights")):
        with pytest.raises(ValueError, match="expected one role or a subset"):
            transposes_apart(bad)


def test_transposes_apart_by_default_only_the_gradients_whose_cast_waits_for_no_amax():
    """Outside `transposes_apart()`, a per-tensor recipe makes the output gradient's
    transposed copy apart exactly where its cast does not wait for the amax (delayed scaling
    without the warm start, or inside the train step's steady state); the activation's and
    the kernel's always by the cast, and every copy by the cast where the amax comes first
    (the warm start, current scaling)."""
    from fp8jax._src.recipes.per_tensor import KNOWN_SCALE_APART, skip_warm_start

    assert KNOWN_SCALE_APART == {"output_grad"}

    def apart(recipe):
        return tuple(r for r in ROLES if recipe.transposes_apart(r))

    known = fp8jax.DelayedScaling(warm_start=False)
    waits = (fp8jax.DelayedScaling(), fp8jax.CurrentScaling(), fp8jax.BlockwiseScaling())
    assert apart(known) == ("output_grad",)
    assert all(apart(r) == () for r in waits)
    for recorded in (False, True):
        with skip_warm_start(recorded=recorded):
            assert apart(fp8jax.DelayedScaling()) == apart(known) == ("output_grad",)
            assert apart(fp8jax.CurrentScaling()) == ()


def test_transposes_apart_change_no_bits(getkey):
    """The transposed copies made apart are the same FP8 values: on a CPU (where the backward
    takes the untransposed product) a delayed-scaling MLP's loss, gradients and new FP8
    state come out bit for bit as without `transposes_apart()`."""
    import numpy as np
    from helpers import SAME_BITS

    from fp8jax._src.recipes.per_tensor import transposes_apart

    config = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(warm_start=False))
    model = fp8jax.fp8_linear_layers(eqx.nn.MLP(16, 4, 32, 2, key=getkey()), config)
    x = jax.random.normal(getkey(), (64, 16))

    def grads(apart):
        def loss(m):
            return jnp.mean(jax.vmap(m)(x) ** 2)

        def run(m):
            if apart:
                with transposes_apart():
                    return fp8jax.filter_value_and_grad(loss)(m)
            return fp8jax.filter_value_and_grad(loss)(m)

        out = eqx.filter_jit(run, compiler_options=SAME_BITS)(model)
        return [np.asarray(a).tobytes() for a in jax.tree.leaves(eqx.filter(out, eqx.is_array))]

    assert grads(True) == grads(False)
