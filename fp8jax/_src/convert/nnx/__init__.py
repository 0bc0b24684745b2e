"""FP8 for Flax NNX: `nnx.Linear` and `nnx.Einsum` with an FP8 `dot_general`, and its state.

An NNX model holds its arrays in `nnx.Variable`s, mutated in place. The FP8 state of a
converted layer (scales and amax histories of its input, kernel and output gradient) lives in
variables of its own type, [`fp8jax.Fp8State`][], inside an [`fp8jax.Fp8NnxDotGeneral`][]
that becomes the layer's `dot_general` (the `einsum_op` of an `nnx.Einsum`). Because the type
is not `nnx.Param`, an `nnx.Optimizer(model, tx, wrt=nnx.Param)` never sees it: no weight
decay, clipping or moment estimate ever touches a scale.

The state is updated as in fp8jax's Equinox path, through the gradient: differentiate with
respect to `(nnx.Param, fp8jax.Fp8State)` and the "gradient" of each `Fp8State` is its new
value. [`fp8jax.nnx_update_fp8_state`][] writes it into the model; the optimizer updates the
Params from the same gradients. [`fp8jax.nnx_value_and_grad`][] differentiates with the state
viewed in a dtype whose cotangents combine by max, so a layer run several times in a step
keeps the largest amax, not their sum:

```python
model = fp8jax.fp8_linear_layers(model)             # an nnx.Module: a converted copy
optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
loss, grads = fp8jax.nnx_value_and_grad(loss_fn)(model, x, y)
fp8jax.nnx_update_fp8_state(model, grads)            # new scales and histories
optimizer.update(model, grads)                       # Params only (wrt=nnx.Param)
```

[`fp8jax.nnx_train_step`][] does all of it in one jitted step.

The package: the layers (`layers`, their Flax-free einsum algebra in `einsum`), the conversion
(`convert`) and the training (`train`, its gradients in `grad`). This file imports nothing,
and Flax is imported only with `layers`, `convert`, `grad` or `train`: `import fp8jax` never
imports it.
"""
