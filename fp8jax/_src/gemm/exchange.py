"""Expert parallelism: the routed tokens of each device sent to the devices that hold their
experts (dispatch), and the experts' outputs sent back (combine), inside `shard_map`.

The experts are split over one mesh axis, `P` devices holding `E / P` consecutive experts
each. Every device routes its own tokens; `ExpertExchange` is what one device needs to know
to move its assignments (token, expert) and to receive those of the others:

- its `A = tokens * top_k` assignments sorted by expert, hence by the device holding it:
  one contiguous chunk per destination;
- the chunks exchanged with `jax.lax.ragged_all_to_all`: each device sends exactly its
  assignments' rows and receives exactly the rows routed to its experts (no capacity, no
  token dropped, no padding on the wire). Its output buffer has a static size: by default the
  worst case, every assignment of every device on one device (`P * A` rows), so the result
  is the single-device MoE's whatever the routing; `capacity` makes it smaller (rows past it
  dropped, as a capacity factor drops tokens);
- the received rows (one chunk per source device, each sorted by expert) put in expert
  order: the rows of a grouped GEMM over the device's experts, with their group sizes.

`combine` is the way back: the experts' output rows to the devices of their tokens, where
each token's `top_k` rows are summed with its routing weights.

XLA's CPU backend has no `ragged-all-to-all`: there the exchange is an `all_to_all` of one
`A`-row slot per device pair with the same semantics (`all_to_all.py`; tests run on CPU
devices; a compile for GPUs takes `ragged_all_to_all`).
"""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from ..core.explicit import explicit_mesh, on_auto_axes, split_evenly
from ..core.formats import fp8_max
from ..recipes import QTensor
from ..recipes.per_tensor_scale import compute_scale
from .all_to_all import ragged_all_to_all


class ExpertExchange(eqx.Module):
    """How one device's routed tokens reach their experts' devices and come back (expert
    parallelism, inside `shard_map`). Made by [`fp8jax.expert_exchange`][].

    **Fields** (per device; `A` assignments, `R` rows received at most, `P` devices):
    `order (A,)` the assignments (flattened `(token, k)`) sorted by expert; `send_sizes`,
    `input_offsets`, `output_offsets`, `recv_sizes`, `return_offsets` `(P,)` the
    `ragged_all_to_all` arguments both ways; `sorted_from (R,)` the received row at each
    row of expert order; `position (R,)` the other way; `group_sizes (E / P,)` the rows of
    each local expert. Static: the mesh `axis_name`, `top_k`, `capacity` (`R`),
    `fp8_backward` (the gradients cross in FP8 too).
    """

    order: Int[Array, " A"]
    send_sizes: Int[Array, " P"]
    input_offsets: Int[Array, " P"]
    output_offsets: Int[Array, " P"]
    recv_sizes: Int[Array, " P"]
    return_offsets: Int[Array, " P"]
    sorted_from: Int[Array, " R"]
    position: Int[Array, " R"]
    group_sizes: Int[Array, " local_experts"]
    axis_name: str = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    capacity: int = eqx.field(static=True)
    fp8_backward: bool = eqx.field(static=True, default=False)

    @property
    def received(self) -> Int[Array, ""]:
        """How many rows this device's experts got (at most `capacity` are kept)."""
        return jnp.minimum(jnp.sum(self.recv_sizes), self.capacity)

    def send(self, rows: Array, fill: float = 0.0) -> Array:
        """`rows (A, ...)`, one per assignment in `order`, to the devices of their experts:
        `(R, ...)` in expert order, `fill` past the received rows. Under Explicit axes (as
        `dispatch`), with those axes Auto: the rows received split as `rows`' are (where
        they divide the capacity), the rest as `rows`'."""
        rows = jnp.asarray(rows)
        spec = self._received_spec(rows)
        move = functools.partial(_send, fill=fill)
        return on_auto_axes(move, self, rows, out_sharding=spec, explicit=spec is not None)

    def send_back(self, rows: Array) -> Array:
        """The inverse of `send`: `rows (R, ...)` in expert order back to the devices of
        their tokens, `(A, ...)` in `order` (zeros for assignments dropped by `capacity`).
        Under Explicit axes (as `dispatch`), with those axes Auto: the assignments split as
        `rows`' rows are (where that divides them), the rest as `rows`'."""
        rows = jnp.asarray(rows)
        spec = self._received_spec(rows, self.order.shape[0])
        return on_auto_axes(_send_back, self, rows, out_sharding=spec, explicit=spec is not None)

    @property
    def _tokens(self) -> int:
        """This device's tokens, as routed."""
        return self.order.shape[0] // self.top_k

    def _check_tokens(self, name: str, shape: tuple[int, ...]) -> None:
        """Raise `ValueError` unless `shape` leads with this device's tokens, as routed."""
        tokens = self._tokens
        if not shape or shape[0] != tokens:
            raise ValueError(
                f"ExpertExchange.{name} has {_rows(shape)} rows (shape {shape}) but the "
                f"exchange routed {tokens} tokens (x top_k {self.top_k}); pass the tokens it "
                "was made for, in the same order."
            )

    @property
    def recv_offsets(self) -> Int[Array, " P"]:
        """Where each peer's tokens start in the received rows: `recv_sizes`' exclusive cumsum."""
        return jnp.cumsum(self.recv_sizes) - self.recv_sizes

    def tokens_of(self, x: Float[Array, "tokens ..."]) -> Array:
        """Each assignment's token row of `x`, in `order`: `(A, ...)`. Under Explicit axes (as
        `dispatch`), with those axes Auto: the assignments split as `x`'s rows are (where
        that divides them), the rest as `x`'s."""
        x = jnp.asarray(x)
        spec = self._received_spec(x, self.order.shape[0])
        return on_auto_axes(_tokens_of, self, x, out_sharding=spec, explicit=spec is not None)

    def dispatch(self, x: Float[Array, "tokens ..."]) -> Array:
        """The rows of `x (tokens, ...)` routed to this device's experts, from every device,
        in expert order: `(R, ...)` (as `x`'s dtype: BF16 stays BF16). An FP8 grouped layer
        given the `ExpertExchange` quantizes first and dispatches FP8 instead."""
        self._check_tokens("dispatch: x", jnp.shape(x))
        x = jnp.asarray(x)
        spec = self._received_spec(x)
        return on_auto_axes(_dispatch, self, x, out_sharding=spec, explicit=spec is not None)

    def _received_spec(self, x: Array, size: int | None = None) -> Any:
        """Under Explicit axes (`None` otherwise), where JAX has no rule for gathering split
        rows, so that the rows of `x (tokens, ...)` move with those axes Auto: the `size`
        rows out (the capacity if `None`) split as `x`'s are (where they divide `size`), the
        rest as `x`'s."""
        if explicit_mesh(x) is None:
            return None
        rows, *rest = tuple(jax.typeof(x).sharding.spec) or (None,)
        mesh = jax.typeof(x).sharding.mesh
        size = self.capacity if size is None else size
        return PartitionSpec(split_evenly(rows, size, mesh), *rest)

    def _send_tokens(self, x: Array, fill: float) -> Array:
        """`send(tokens_of(x), fill)`, under Explicit axes as `dispatch`."""
        spec = self._received_spec(x)

        def move(plan: ExpertExchange, x: Array) -> Array:
            return plan.send(plan.tokens_of(x), fill)

        return on_auto_axes(move, self, x, out_sharding=spec, explicit=spec is not None)

    def dispatch_quantized(self, q: QTensor) -> QTensor:
        """`q`, this device's tokens quantized (`(tokens, K)` FP8 data; a per-tensor scale,
        or one scale per tile of a row), as `dispatch` sends a high-precision activation:
        the FP8 rows and their tiles' scales cross the mesh; a per-tensor scale, global,
        stays (every device has it). Rows past the received ones: zeros, scales of 1."""
        tokens = q.data.shape[0]
        self._check_tokens("dispatch_quantized: q.data", q.data.shape)
        data = self._send_tokens(q.data, 0.0)
        scale = q.scale_inv
        if scale.ndim and scale.shape[0] == tokens:
            scale = self._send_tokens(scale, 1.0)
        return QTensor(data, scale, q.block)

    def gradient_back(self, d_rows: Float[Array, "R ..."]) -> Float[Array, "tokens ..."]:
        """The gradient of `dispatch` (or `dispatch_quantized`): `d_rows (R, ...)`, the
        gradient of the rows this device's experts received, back to the devices of their
        tokens and summed over each token's `top_k` assignments: `(tokens, ...)`. Under
        Explicit axes (as `dispatch`), with those axes Auto: the tokens split as `d_rows`'
        rows are (where that divides the tokens), the rest as `d_rows`'."""
        d_rows = jnp.asarray(d_rows)
        spec = None
        if explicit_mesh(d_rows) is not None:
            rows, *rest = tuple(jax.typeof(d_rows).sharding.spec) or (None,)
            mesh = jax.typeof(d_rows).sharding.mesh
            spec = PartitionSpec(split_evenly(rows, self._tokens, mesh), *rest)
        return on_auto_axes(
            _gradient_back, self, d_rows, out_sharding=spec, explicit=spec is not None
        )

    def _gradient(self, rows: Array, move: Any) -> Array:
        """`move(rows)`: in their dtype, or with `fp8_backward` as E4M3 in 1 x 128 tiles of
        a row (power-of-two scales from each tile's amax) with their float32 scales,
        dequantized on arrival to `rows`' dtype. A row is all of one token's values (its
        axes after the first, flattened)."""
        if not self.fp8_backward:
            return move(rows)
        flat = rows.reshape(rows.shape[0], -1)
        data, scale_inv = quantize_tiles(flat)
        moved = dequantize_tiles(move(data), move(scale_inv), flat.shape[-1], rows.dtype)
        return moved.reshape(moved.shape[:1] + rows.shape[1:])

    def combine(
        self, y: Float[Array, "R ..."], weights: Float[Array, "tokens top_k"]
    ) -> Float[Array, "tokens ..."]:
        """The experts' output rows `y (R, ...)` (expert order, this device's experts) back
        to the devices of their tokens, each token's `top_k` rows summed with its routing
        `weights (tokens, top_k)`: `(tokens, ...)`, in `y`'s dtype."""
        if not jnp.shape(y) or jnp.shape(y)[0] != self.capacity:
            raise ValueError(
                f"ExpertExchange.combine: y has {_rows(jnp.shape(y))} rows (shape "
                f"{jnp.shape(y)}); it should be the experts' output rows, as many as the "
                f"exchange's capacity ({self.capacity}), in expert order (what a layer given "
                "this exchange, or its group_sizes, returns)."
            )
        tokens = self._tokens
        if jnp.shape(weights) != (tokens, self.top_k):
            raise ValueError(
                f"ExpertExchange.combine: weights of shape {jnp.shape(weights)}; they should "
                f"be (tokens, top_k) = {(tokens, self.top_k)}, each token's routing weights "
                "in the order of the experts it was planned with."
            )
        y, weights = jnp.asarray(y), jnp.asarray(weights)
        # Under Explicit axes (as `dispatch`), with those axes Auto: the tokens split as
        # `weights`' are, the rest as `y`'s.
        explicit = explicit_mesh(y, weights) is not None
        spec = None
        if explicit:
            rows = jax.typeof(weights).sharding.spec[0]
            spec = PartitionSpec(rows, *jax.typeof(y).sharding.spec[1:])
        return on_auto_axes(_weighted_sum, self, y, weights, out_sharding=spec, explicit=explicit)


def _weighted_sum(plan: ExpertExchange, y: Array, weights: Array) -> Array:
    """`plan.combine(y, weights)`, its arguments checked."""
    back = _combine(plan, y)  # (A, ...) in order
    w = weights.reshape(-1)[plan.order].astype(y.dtype)
    w = w.reshape((-1,) + (1,) * (y.ndim - 1))
    # Added to the tokens in expert order, as one device sorting its tokens would.
    out = jnp.zeros((weights.shape[0], *y.shape[1:]), y.dtype)
    return out.at[plan.order // plan.top_k].add(back * w)


def _tokens_of(plan: ExpertExchange, x: Array) -> Array:
    """`plan.tokens_of(x)` on the axes it is given."""
    return x[plan.order // plan.top_k]


def _send(plan: ExpertExchange, rows: Array, fill: float) -> Array:
    """`plan.send(rows, fill)` on the axes it is given."""
    recv = ragged_all_to_all(
        rows,
        jnp.zeros((plan.capacity, *rows.shape[1:]), rows.dtype),
        plan.input_offsets,
        plan.send_sizes,
        plan.output_offsets,
        plan.recv_sizes,
        axis_name=plan.axis_name,
    )
    valid = jnp.arange(plan.capacity) < plan.received
    mask = valid.reshape((-1,) + (1,) * (rows.ndim - 1))
    return jnp.where(mask, recv[plan.sorted_from], jnp.asarray(fill, rows.dtype))


def _send_back(plan: ExpertExchange, rows: Array) -> Array:
    """`plan.send_back(rows)` on the axes it is given."""
    received = rows[plan.position]
    return ragged_all_to_all(
        received,
        jnp.zeros((plan.order.shape[0], *rows.shape[1:]), rows.dtype),
        plan.recv_offsets,
        plan.recv_sizes,
        plan.return_offsets,
        plan.send_sizes,
        axis_name=plan.axis_name,
    )


def _gradient_back(plan: ExpertExchange, d_rows: Array) -> Array:
    """`plan.gradient_back(d_rows)` on the axes it is given."""
    back = plan._gradient(d_rows, plan.send_back)  # (A, ...) in order
    zeros = jnp.zeros((plan._tokens, *d_rows.shape[1:]), d_rows.dtype)
    return zeros.at[plan.order // plan.top_k].add(back)


def _rows(shape: tuple[int, ...]) -> Any:
    """How errors count the rows of an array of `shape`."""
    return shape[0] if shape else "no"


# Dispatch and combine are each other's transpose: their gradients are the other exchange
# (custom_vjp: one code path for the forward and backward exchanges of every layer).
@jax.custom_vjp
def _dispatch(plan: ExpertExchange, x: Array) -> Array:
    return plan.send(plan.tokens_of(x))


def _dispatch_fwd(plan, x):
    return _dispatch(plan, x), plan


def _dispatch_bwd(plan, g):
    return _zero_plan(plan), plan.gradient_back(g)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _combine(plan: ExpertExchange, y: Array) -> Array:
    return plan.send_back(y)


def _combine_fwd(plan, y):
    return _combine(plan, y), plan


def _combine_bwd(plan, g):
    return _zero_plan(plan), plan._gradient(g, plan.send)


_combine.defvjp(_combine_fwd, _combine_bwd)


#: The tile of `fp8_backward`'s quantization: 128 values of a row (DeepSeek-V3's activations').
TILE = 128


def quantize_tiles(rows: Float[Array, "N K"]) -> tuple[Array, Float[Array, "N tiles"]]:
    """`rows` as E4M3 in tiles of `TILE` values of a row (the last, padded; a row of
    `K < TILE` values is one tile), each scaled by the largest power of two that keeps its
    amax within E4M3's range: `(data (N, tiles * min(TILE, K)), scale_inv (N, tiles))` (a
    tile of zeros: scale 1)."""
    k = rows.shape[-1]
    tile = min(TILE, k)
    x = rows.astype(jnp.float32)
    x = jnp.pad(x, ((0, 0), (0, -k % tile))).reshape(rows.shape[0], -1, tile)
    amax = jnp.max(jnp.abs(x), axis=-1)
    fmt = jnp.float8_e4m3fn
    scale = compute_scale(amax, jnp.ones_like(amax), fp8_max(fmt), power_of_two=True)
    data = (x * scale[..., None]).astype(fmt).reshape(rows.shape[0], -1)
    return data, 1.0 / scale


def dequantize_tiles(data: Array, scale_inv: Array, k: int, dtype: Any) -> Array:
    """Undo `quantize_tiles`: `(N, k)` in `dtype`."""
    tiles = scale_inv.shape[-1]
    x = data.astype(jnp.float32).reshape(data.shape[0], tiles, -1) * scale_inv[..., None]
    return x.reshape(data.shape[0], -1)[:, :k].astype(dtype)


def _zero_plan(plan: ExpertExchange) -> Any:
    """The (nonexistent) cotangent of a plan: integer arrays take `float0` zeros."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jax.dtypes.float0), plan)


def expert_exchange(
    experts: Int[Array, "tokens top_k"],
    num_experts: int,
    axis_name: str,
    *,
    capacity: int | None = None,
    fp8_backward: bool = False,
) -> ExpertExchange:
    """The `ExpertExchange` of this device's routed tokens, inside `shard_map` over
    `axis_name`, whose `P` devices hold `num_experts / P` consecutive experts each.

    **Arguments:**

    - `experts (tokens, top_k)`: each of this device's tokens' experts (an array or nested
      lists; global indices, in `[0, num_experts)`; a choice outside is sent nowhere, and
      its token's share of the output is 0: traced indices cannot be checked).
    - `num_experts`: all experts, a multiple of the axis size.
    - `axis_name`: the mesh axis the experts are split over (its name, a str: one axis, which
      the enclosing `shard_map` splits).
    - `capacity`: the rows a device's experts can receive (static). `None`: the worst case,
      `P * tokens * top_k` (at least 1), so that no routing drops a token (the
      single-device MoE's result); smaller saves memory and GEMM rows past the received
      ones, and drops the rows past it.
    - `fp8_backward`: also send the backward's two exchanges (the gradient of the
      dispatched rows going back, the output gradient of the combine going out) in FP8:
      E4M3 in 1 x 128 tiles of a row with float32 scales, dequantized on arrival (half the
      bytes of BF16 gradients, and one more rounding of them). Off by default: the
      gradients cross in their own dtype, as DeepSeek-V3's combine does.
    """
    if not isinstance(axis_name, str):
        raise TypeError(
            f"expert_exchange: axis_name={axis_name!r}: should be the name (a str) of the one "
            "mesh axis the experts are split over, as expert_specs takes it."
        )
    devices = _axis_size(axis_name)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int | np.integer):
        raise TypeError(f"expert_exchange: num_experts={num_experts!r}: should be an int >= 1.")
    if num_experts < 1:
        raise ValueError(f"expert_exchange: num_experts={num_experts!r}: should be an int >= 1.")
    if num_experts % devices:
        raise ValueError(
            f"expert_exchange: num_experts={num_experts} does not split over the {devices} "
            f"devices of mesh axis {axis_name!r}; use a multiple of {devices}."
        )
    if not isinstance(experts, jax.Array | np.ndarray):  # nested lists: an array
        try:
            experts = jnp.asarray(experts)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"expert_exchange: experts={experts!r}: should be (tokens, top_k) integers, "
                "an array or nested lists of ints."
            ) from e
    if experts.ndim != 2 or not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(
            f"expert_exchange: experts {experts.shape} {experts.dtype}: should be "
            "(tokens, top_k) integers, each token's experts."
        )
    tokens, top_k = experts.shape
    if top_k < 1:
        raise ValueError(
            f"expert_exchange: experts {experts.shape}: each token should go to at least one "
            "expert (top_k >= 1)."
        )
    assignments = tokens * top_k
    # No tokens at all still get a buffer (of one row, received by nothing).
    capacity = max(devices * assignments, 1) if capacity is None else capacity
    if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 1:
        raise ValueError(f"expert_exchange: capacity={capacity!r}: should be an int >= 1.")
    capacity, num_experts = int(capacity), int(num_experts)
    if not isinstance(fp8_backward, bool):
        raise ValueError(f"expert_exchange: fp8_backward={fp8_backward!r}: should be a bool.")
    # Under a mesh whose Explicit axes split the tokens (a `shard_map` over the experts' axis
    # alone), JAX cannot sort along a split axis: the plan is made with those axes Auto, and
    # every device of them holds all of it.
    explicit = explicit_mesh(experts) is not None
    plan = functools.partial(
        _plan,
        num_experts=num_experts,
        axis_name=axis_name,
        capacity=capacity,
        fp8_backward=fp8_backward,
    )
    sharding = PartitionSpec() if explicit else None
    return on_auto_axes(plan, experts, out_sharding=sharding, explicit=explicit)


def _axis_size(axis_name: str) -> int:
    """The size of mesh axis `axis_name`, which the enclosing `shard_map` must split (lax
    says only "unbound axis name")."""
    try:
        return lax.axis_size(axis_name)
    except NameError:
        mesh = jax.sharding.get_abstract_mesh()
        manual = jax.sharding.AxisType.Manual
        axes = tuple(
            n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == manual
        )
        raise ValueError(
            f"expert_exchange: axis_name={axis_name!r} is not a mesh axis that the enclosing "
            f"shard_map splits (those: {axes}); name the one the experts are split over, "
            "from inside the shard_map."
        ) from None


def _plan(
    experts: Array, *, num_experts: int, axis_name: str, capacity: int, fp8_backward: bool
) -> ExpertExchange:
    """`expert_exchange`, its arguments checked."""
    devices = lax.axis_size(axis_name)
    top_k = experts.shape[1]
    local = num_experts // devices
    flat = experts.reshape(-1)
    # A choice outside the experts goes past the last one: sent nowhere (bincount would
    # count a negative one as expert 0's).
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # (E,) of this device
    send_sizes = counts.reshape(devices, local).sum(-1)
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    every = lax.all_gather(counts, axis_name).reshape(devices, devices, local)  # src, dst, e
    me = lax.axis_index(axis_name)
    per_pair = every.sum(-1)  # (src, dst)
    # Where this device's chunk lands in each destination's buffer: after the chunks of the
    # devices before it. A chunk past the destination's capacity is cut (its rows dropped).
    output_offsets = (jnp.cumsum(per_pair, axis=0) - per_pair)[me]
    send_sizes = jnp.clip(capacity - output_offsets, 0, send_sizes)
    mine = jnp.take(every, me, axis=1)  # (src, local experts): what this device receives
    recv_sizes = mine.sum(-1)
    recv_start = jnp.cumsum(recv_sizes) - recv_sizes
    recv_sizes = jnp.clip(capacity - recv_start, 0, recv_sizes)
    # The way back: this device's chunk from source i lands where source i sent it from.
    return_offsets = lax.all_to_all(input_offsets, axis_name, 0, 0, tiled=True)
    # Each received row's local expert: chunks by source, each sorted by expert.
    row = jnp.arange(capacity, dtype=jnp.int32)
    ends = (recv_start[:, None] + jnp.cumsum(mine, axis=1)).reshape(-1)  # (src * e)
    # One comparison per (row, piece) in one fusion; a binary search is a loop of kernels.
    # (`searchsorted`'s "compare_all" written out: JAX's fails in a partly manual shard_map.)
    after = jnp.sum(ends[None, :] <= row[:, None], axis=1, dtype=jnp.int32)
    piece = jnp.clip(after, 0, devices * local - 1)
    expert = (piece % local).astype(jnp.int32)
    valid = row < jnp.sum(recv_sizes)
    # Expert order: by expert, then by source, each source's rows in its order (the order
    # of one device sorting all tokens, when the tokens are split over the devices in order).
    sorted_from = jnp.argsort(jnp.where(valid, expert, local), stable=True).astype(jnp.int32)
    position = jnp.zeros(capacity, jnp.int32).at[sorted_from].set(row)
    group_sizes = jnp.bincount(jnp.where(valid, expert, local), length=local + 1)[:local]
    group_sizes = group_sizes.astype(jnp.int32)
    return ExpertExchange(
        order=order,
        send_sizes=send_sizes,
        input_offsets=input_offsets,
        output_offsets=output_offsets,
        recv_sizes=recv_sizes,
        return_offsets=return_offsets,
        sorted_from=sorted_from,
        position=position,
        group_sizes=group_sizes,
        axis_name=axis_name,
        top_k=top_k,
        capacity=capacity,
        fp8_backward=fp8_backward,
    )
