"""fp8jax's trace-time settings are part of JAX's cache keys: a function jitted outside a
setting's `with` and called inside is traced again inside, not given back as traced outside.
"""

import ast
import contextlib
import contextvars
import pathlib
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax._src.core import contexts
from fp8jax._src.core.compile_options import cublas_traced, is_cublas_traced
from fp8jax._src.gemm.batching import per_example_gradients, per_example_traced
from fp8jax._src.kernels import choice, dispatch, partition, quantize_config
from fp8jax._src.recipes import per_tensor, per_tensor_pass

#: Each context fp8jax traces under, what a function traced inside reads of it, and the
#: context around both where the default reads the same.
CONTEXTS = {
    "cublas_traced": (cublas_traced, is_cublas_traced),
    "skip_warm_start": (per_tensor.skip_warm_start, per_tensor.warm_start_skipped),
    "skip_warm_start recorded": (
        lambda: per_tensor.skip_warm_start(recorded=True),
        per_tensor.scales_known_recorded,
    ),
    "transposes_apart": (
        lambda: per_tensor.transposes_apart("input"),
        lambda: per_tensor.transposes_apart_chosen("input"),
    ),
    "transposes_in_words": (
        per_tensor.transposes_in_words,
        per_tensor.transposes_in_words_chosen,
    ),
    "cast_transpose_kernel": (
        lambda: per_tensor_pass.cast_transpose_kernel("kernel", on_tensor_cores=True),
        lambda: (
            per_tensor_pass.cast_transpose_chosen("kernel"),
            per_tensor_pass.tensor_cores_chosen(),
        ),
    ),
    "persistent_kernel": (choice.persistent_kernel, lambda: choice.persistent_config("dense")),
    # Inside `persistent_kernel()` (on a CPU the tiled kernels are the default).
    "tiled_kernel": (
        choice.tiled_kernel,
        lambda: choice.persistent_config("dense"),
        choice.persistent_kernel,
    ),
    "weight_block_scales": (choice.weight_block_scales, choice.weight_block_scales_chosen),
    "chained_pipelines": (
        choice.chained_pipelines,
        lambda: choice.persistent_config("dense"),
        choice.persistent_kernel,
    ),
    "tensor_core_quantization": (
        choice.tensor_core_quantization,
        choice.tensor_core_quantization_chosen,
    ),
    "quantize_slabs": (
        lambda: quantize_config.quantize_slabs(16),
        lambda: quantize_config.resolved(quantize_config.OTHER_TUNING),
    ),
    "interpreted": (dispatch.interpreted, dispatch.interpreting),
    "per_example_gradients": (per_example_gradients, per_example_traced),
}


@pytest.mark.parametrize("name", list(CONTEXTS))
def test_a_function_jitted_outside_is_traced_again_inside(name):
    context, read, around = (*CONTEXTS[name], contextlib.nullcontext)[:3]
    seen = []

    @jax.jit
    def inner(x):
        seen.append(read())
        return x + 1

    def outer(x):  # a new jit each time: only `inner`'s caches could give back a trace
        return inner(x) * 2

    with around():
        jax.jit(outer).lower(1.0)
        with context():
            jax.jit(outer).lower(1.0)
            jax.jit(outer).lower(1.0)  # traced once inside: then a cache hit, as it should
        jax.jit(outer).lower(1.0)
        assert read() == seen[0]  # back after the `with`
    assert len(seen) == 2, seen
    assert seen[0] != seen[1], f"{name}: traced inside, `inner` read {seen[1]!r} as outside"


def test_every_trace_time_choice_is_a_setting():
    """The only context variables left are recorders (lists a `with` fills, plans replayed
    in tests): whatever chooses what is traced is a `contexts.Setting`, in the cache keys."""
    recorders = {("compile_options.py", "_CUBLAS_READS"), ("partition.py", "_PLANS")}
    found = set()
    for path in pathlib.Path(fp8jax.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and "ContextVar(" in ast.unparse(node.value or node):
                found.add((path.name, ast.unparse(node.target)))
    assert found == recorders
    names = [
        node.args[0].value
        for path in pathlib.Path(fp8jax.__file__).parent.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Setting")
    ]
    assert len(names) == len(set(names)) >= len(CONTEXTS), names


def test_a_forward_jitted_for_the_warm_step_is_traced_again_for_the_fast_one(getkey):
    """`fp8jax.without_warm_start`'s pattern (a warm step, then the same step without the
    warm start) where the model's forward is jitted on its own: the fast step traces the
    forward again, and is the program it is where the warm step never ran."""
    model = fp8jax.fp8_linear_layers(
        eqx.nn.MLP(8, 1, 32, 2, key=getkey()), fp8jax.Fp8Config(recipe="delayed")
    )
    x = jax.random.normal(getkey(), (16, 8))
    y = jnp.tanh(x[:, :1])

    def programs(warm_first: bool) -> tuple[str, str]:
        forward = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))

        def step(m, x, y):
            return fp8jax.filter_grad(lambda m: jnp.mean((forward(m, x) - y) ** 2))(m)

        warm, fast = eqx.filter_jit(step), eqx.filter_jit(fp8jax.without_warm_start(step))
        order = (warm, fast) if warm_first else (fast, warm)
        traced = {f: str(eqx.filter_make_jaxpr(f)(model, x, y)[0]) for f in order}
        return traced[warm], traced[fast]

    warm, fast = programs(warm_first=True)
    assert warm != fast  # the warm start's choice of scale is in one program only
    assert (warm, fast) == programs(warm_first=False)


def test_settings_restore_nest_and_travel_to_other_threads():
    var = contexts.Setting("fp8jax_test_setting", 0)
    plain = contextvars.ContextVar("fp8jax_test_variable", default="outside")
    assert var.get() == 0
    with contexts.setting(var, 1):
        with pytest.raises(RuntimeError):
            with contexts.setting(var, 2):
                assert var.get() == 2
                raise RuntimeError
        assert var.get() == 1
        token = plain.set("inside")
        run = contexts.carried()  # as XLA's partitioner calls a sharded kernel's trace
        plain.reset(token)
    assert var.get() == 0
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append((var.get(), run(var.get), plain.get(), run(plain.get)))
    )
    thread.start()
    thread.join()
    # The setting and the context variable as they were at `carried()`, on the other thread.
    assert seen == [(0, 1, "outside", "inside")]
    assert repr(var) == "Setting('fp8jax_test_setting', value=0)"
    with pytest.raises(TypeError, match=r"'fp8jax_test_setting': value=\[1\] is not hashable"):
        with contexts.setting(var, [1]):
            pass
    assert partition.inside() is False


@pytest.mark.parametrize("roles", [None, 5, b"input", [["input"]], ["input", 3]])
def test_role_contexts_refuse_what_names_no_roles_by_value(roles):
    """`transposes_apart(None)` and `cast_transpose_kernel(5)` said only "'NoneType' object is
    not iterable" (a TypeError), `b"input"` was read as the roles `(105, 110, ...)`: each is
    refused by value, with the roles taken."""
    for context in (per_tensor.transposes_apart, per_tensor_pass.cast_transpose_kernel):
        with pytest.raises(ValueError, match=r"roles=.*expected one role or a"):
            context(roles)


@pytest.mark.parametrize("recorded", ["no", None, 0, 1])
def test_skip_warm_start_takes_a_bool(recorded):
    """`skip_warm_start(recorded="no")` was taken for `recorded=True`: a state without a scale
    then cast by 0 (all-zero outputs). Refused by value."""
    with pytest.raises(ValueError, match=rf"skip_warm_start: recorded={recorded!r}; expected"):
        per_tensor.skip_warm_start(recorded)


def test_cublas_reads_counts_the_reads_inside_its_with_only():
    """`cublas_reads()` grows by one per `is_cublas_traced()` read inside the `with`, nested
    ones in their own list only, and none after it (an exception included)."""
    from fp8jax._src.core.compile_options import cublas_reads

    with cublas_reads() as outer:
        is_cublas_traced()
        with pytest.raises(RuntimeError), cublas_reads() as inner:
            is_cublas_traced()
            raise RuntimeError
        is_cublas_traced()
    is_cublas_traced()
    assert (outer, inner) == ([True, True], [True])
