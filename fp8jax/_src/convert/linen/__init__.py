"""FP8 for Flax Linen models nobody may edit: `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum`
layers, wherever they are built, run as fp8jax's FP8 GEMMs.

Linen builds its layers inside `__call__` (or `setup`) of modules the user may not own
(MaxText, big_vision, t5x): there is no layer object to swap before the model runs, as there
is in Equinox or NNX. So the conversion happens while the model runs, through Flax's own
hook, `nn.intercept_methods`: [`fp8jax.Fp8Linen`][] wraps `init` and `apply` in an
interceptor that sees every module call with the module bound, so it knows the layer's path
(for `Fp8Config`'s targets and per-layer recipes) and can declare variables in the layer's
scope. A chosen `Dense`/`DenseGeneral` runs with fp8jax's FP8 `dot_general` as its
`dot_general` for that call; a chosen `Einsum` with `jnp.einsum` answered by fp8jax's FP8
einsum for that call. The model's code, and its parameters' paths, are unchanged.

Why not intercept `lax.dot_general` at trace time, as Qwix does? Delayed scaling keeps
state between steps, and a trace-time hook has no place to keep it; Linen's interceptor
runs inside the layer's scope, where the state becomes an ordinary Linen variable that
lifted transforms (`nn.scan`, `nn.remat`, `nn.vmap`) carry like any other. The recipes that
keep no state can also reach any function by trace-time interception.

Each layer's state is one [`fp8jax.Fp8DotGeneral`][] stored as a variable named `"fp8jax"` in
the collection `"_overwrite_with_gradient"`: Flax's own convention for FP8 state, so
`nn.scan(..., variable_axes={"_overwrite_with_gradient": 0})` written for Flax's FP8 ops
carries it, and Flax's `TrainState` optimises only `"params"`. The state is updated through
the gradient: differentiate the whole variables (with [`fp8jax.filter_value_and_grad`][],
which combines a shared layer's uses by max), and [`fp8jax.LinenTrainState`][] (or
`fp8jax.partition_for_grad_overwrite` / `fp8jax.apply_updates`) merges the new state.

The package: the conversion (`convert`) and the train state (`train`). This file imports
nothing, and Flax is imported only with `convert` or `train`: `import fp8jax` never imports it.
"""
