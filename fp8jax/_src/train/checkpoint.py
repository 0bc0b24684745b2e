"""Save and restore a whole training state (model, FP8 state, optimizer, loss scale).

The checkpoint records what it holds: every array's path, shape and dtype (and a Haliax
`NamedArray`'s axis names), and each FP8 layer's name and recipe. [`fp8jax.load_checkpoint`][]
compares that record with the state it restores into before it reads a single array, so
restoring into a model with other FP8 targets or recipes fails with a message naming the
difference, and never half-loads.

Two formats: one file written with `eqx.tree_serialise_leaves` (the default), or an
orbax-checkpoint directory (`backend="orbax"`, the `orbax` extra), both with the same record.

In a multi-process run (`jax.distributed.initialize`) every process calls both functions with
the same arguments. The Equinox file is written by process 0 from arrays gathered whole to every
process; orbax writes each process's own shards. Arrays are restored with the shardings of the
`like` state's arrays, so a state saved by several processes restores in one, and the other
way round.

```python
fp8jax.save_checkpoint("ckpt.eqx", state)
state = fp8jax.load_checkpoint("ckpt.eqx", like=train_step.init(model))
```
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .checkpoint_files import (
    file_mode,
    make_parents,
    naming,
    remove,
    replace_directory,
    sync_directory,
    sync_file,
)
from .checkpoint_hosts import gather, on_concrete_mesh, on_process_zero, placed_as
from .checkpoint_keys import keyed_record, keys_as_data, keys_from_data
from .checkpoint_orbax import check_restorable, restore_arrays, save_arrays
from .checkpoint_record import (
    MAGIC,
    check_format,
    check_fp8_record,
    corrupt,
    is_array_like,
    parse_record,
)
from .checkpoint_states import as_stored, settled, warn_non_finite, without_non_finite_amaxes
from .orbax_quiet import quiet_orbax_leftovers

T = TypeVar("T")

_RECORD = "fp8jax_record.json"
_FORMAT = "fp8jax_format"  # an orbax checkpoint's version (one without it: version 1)
_BACKENDS = ("equinox", "orbax")


def save_checkpoint(path: str | os.PathLike, state: Any, *, backend: str = "equinox") -> None:
    """Write `state` (any pytree: a `TrainState`, a model, ...) to `path`.

    **Arguments:**

    - `path`: a file (`backend="equinox"`) or a directory (`backend="orbax"`). It is written
      completely or not at all: the data goes to a temporary name first, and is on disk (`fsync`)
      before it replaces a previous checkpoint, a power loss too. A leading `~` is the home
      directory (`os.path.expanduser`); missing parent directories are made. A symbolic link at
      `path` is replaced, its target kept. An orbax save replaces only a checkpoint it wrote (else
      `FileExistsError`, nothing written). A save that raises (orbax cannot write a leaf, a full
      disk) leaves `path` as it was and no `<path>.tmp`. An orbax save stopped (killed) between its
      two renames leaves no `path`, the checkpoint it replaced at `<path>.old` and its own,
      complete, at `<path>.tmp`; [`fp8jax.load_checkpoint`][] names them (and an Equinox save's
      `<path>.*.tmp` file, if one was killed before its rename), saying which to rename to `path`.
    - `state`: the pytree to save. Static fields (recipes, configuration) are not saved:
      they come from the `like` given to [`fp8jax.load_checkpoint`][]; with `"orbax"`,
      neither are Python numbers among the leaves (their types are recorded and checked):
      keep a count that must survive a restart in an array (a step counter as
      `jnp.int32(0)`); and it refuses (`ValueError`, before writing) two leaves whose keys
      joined with `.` are one name, as orbax names them (`{"a.b": x, "a": {"b": y}}`).
      PRNG keys (`jax.random.key`, an NNX model's `nnx.Rngs`) are saved as their data and
      restored as keys of `like`'s implementation.
    - `backend`: `"equinox"` (`eqx.tree_serialise_leaves`) or `"orbax"` (orbax-checkpoint).

    **Several processes** (`jax.distributed.initialize`): every process must call it, with the
    same `path` and a state of the same structure. With `"equinox"`, arrays that span other
    processes' devices are gathered whole to every process (host memory for the full state on
    each) and process 0 alone writes the file; with `"orbax"`, each process writes its own
    shards into `path`, which must be on a file system all processes share. Every process
    returns once the checkpoint is complete, and raises if process 0 failed to write it.
    """
    _check_backend(backend)
    path = _as_path(path, "save_checkpoint")
    data = keys_as_data(state)
    record = json.dumps(keyed_record(state, data)).encode()
    state = data
    _check_savable(state)
    if backend == "orbax":
        _orbax_save(path, state, record)
        return
    state = gather(state)
    on_process_zero("write the checkpoint", lambda: _equinox_save(path, state, record))


def _equinox_save(path: pathlib.Path, state: Any, record: bytes) -> None:
    if path.is_dir():
        raise IsADirectoryError(
            f"save_checkpoint: {os.fspath(path)!r} is a directory; backend='equinox' writes a "
            "file (give a file name; orbax checkpoints are directories: backend='orbax')."
        )
    with naming(path):
        make_parents(path)
        tmp = tempfile.NamedTemporaryFile(
            dir=path.parent, prefix=path.name + ".", suffix=".tmp", delete=False
        )
    try:
        with tmp as f:
            f.write(MAGIC)
            f.write(len(record).to_bytes(8, "little"))
            f.write(record)
            eqx.tree_serialise_leaves(f, state, filter_spec=_serialise)
            sync_file(f)
        os.chmod(tmp.name, file_mode(path))
        os.replace(tmp.name, path)
        sync_directory(path.parent)
    except BaseException:
        os.unlink(tmp.name)  # a failed save leaves no stray temporary file behind
        raise


def load_checkpoint(path: str | os.PathLike, like: T, *, backend: str = "equinox") -> T:
    """The state saved at `path`, restored into the structure of `like`.

    **Arguments:**

    - `path`: what [`fp8jax.save_checkpoint`][] wrote.
    - `like`: a state of the same structure (e.g. `train_step.init(model)` for a model built
      as before); its arrays' values are ignored, its static configuration is kept. Its
      arrays may be abstract, `jax.ShapeDtypeStruct`s (`eqx.filter_eval_shape(train_step.init,
      model)`: no state built only to be overwritten).
    - `backend`: as when saving.

    **Returns:** a new state; `like` is not modified. A Flax NNX object that `like` holds at
    several places (a layer used twice) is one object in it too. Each array has the sharding of the
    corresponding array of `like` (a `jax.Array`, or a `jax.ShapeDtypeStruct`'s sharding:
    one on a single device other than the default one puts the array there), committed where
    that array is (uncommitted where `jnp.zeros` made it). A `like` made by `eval_shape`
    carries no device (under JAX's default, Auto, mesh axes it names no sharding): its arrays
    restore whole on the default device, uncommitted, whatever the model was sharded over; to
    restore them sharded, give each `jax.ShapeDtypeStruct` its sharding. Under Explicit axes
    it names shardings on the abstract mesh: load under `jax.set_mesh(mesh)`, which restores
    them on `mesh` (else `ValueError`, before reading). The sharding may
    differ from the one an array was saved with: a checkpoint written by several processes
    restores in one, and the other way round. With several processes every process calls it
    and reads `path`, which they must all see. A NaN or an inf in an FP8 layer's state, which
    training never records, is warned of (`RuntimeWarning`, naming the leaf): in an amax
    history it is set to 0, no amax recorded (kept, every step would be non-finite and
    skipped); a scale is loaded as it is (delayed scaling's is computed again from its
    history).

    **Raises:** `ValueError`, before anything is read, if the checkpoint's FP8 layers, recipes
    or arrays differ from `like`'s (the message lists the differences; recipe options that
    choose only how a GEMM runs, such as `native_kernel`, `dequantized_dot`, `chunks_per_dot`,
    `weight_gather`, `backward_precision`, `axis_names`, `use_scaled_matmul` and `warm_start`,
    may differ: resume a CPU run on a GPU, or a run on another mesh), or if a Haliax
    `NamedArray`'s axis names differ from the saved ones, in name or order (a weight saved as
    `(hidden, embed)` is not read as `(embed, hidden)`: to restore it under other axes, give
    `like` the saved ones, with `haliax.rename` or built in the saved order, load, then rename
    or `haliax.rearrange` the result; a checkpoint written before fp8jax recorded axis names
    restores unchecked), or, with `"orbax"`, if two of `like`'s leaves have one orbax name (as
    `save_checkpoint` refuses: a checkpoint saved before it did holds one array for both);
    `ValueError` for a file or directory that is not a checkpoint, is of a later format version
    (named), or is truncated or corrupt (data missing or left over; an orbax directory copied
    half-way); `FileNotFoundError` if nothing is at `path`, naming what a save to it stopped
    half-way left beside it (its new checkpoint, the one it replaced) and which to rename to
    `path`.
    """
    _check_backend(backend)
    path = _as_path(path, "load_checkpoint")
    if backend == "orbax":
        saved = parse_record(_orbax_record(path), path)
        target = _target(saved, like)
        check_fp8_record(saved, keyed_record(target, data := keys_as_data(target)), path)
        data = on_concrete_mesh(data)  # (the keys' data: converted once, for both)
        return _ready(keys_from_data(_orbax_load(path, data), target), like, path)
    if not path.exists():
        raise _no_checkpoint(path, backend)
    if path.is_dir():
        raise IsADirectoryError(
            f"load_checkpoint: {os.fspath(path)!r} is a directory; backend='equinox' reads the "
            "file save_checkpoint wrote (orbax checkpoints are directories: backend='orbax')."
        )
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        magic = f.readline(64)
        check_format(magic, path)
        if magic != MAGIC:
            raise ValueError(
                f"{os.fspath(path)!r} is not an fp8jax checkpoint (it does not start with "
                f"{MAGIC!r}); write one with fp8jax.save_checkpoint."
            )
        header = f.read(8)
        size = int.from_bytes(header, "little")
        if len(header) < 8 or size > total - f.tell():
            raise corrupt(path, f"its record is cut off ({total} bytes in all)")
        saved = parse_record(f.read(size), path)
        target = _target(saved, like)
        check_fp8_record(saved, keyed_record(target, data := keys_as_data(target)), path)
        data = on_concrete_mesh(data)  # (the keys' data: converted once, for both)
        try:
            restored = eqx.tree_deserialise_leaves(f, data, filter_spec=_deserialise)
        except Exception as e:  # noqa: BLE001 - any failure to read the arrays: truncated
            raise corrupt(path, f"its arrays could not be read ({e})") from e
        if f.read(1):
            raise corrupt(path, f"it has data after the saved state ({total} bytes in all)")
        return _ready(keys_from_data(restored, target), like, path)


def _ready(restored: T, like: T, path: pathlib.Path) -> T:
    """`restored` settled (a NaN or inf in its FP8 states dropped, or warned of), as `like`."""
    restored, more = without_non_finite_amaxes(restored, path)
    restored = settled(restored)
    if more:
        warn_non_finite(restored, path)
    return _shared_as(restored, like)


def _shared_as(restored: T, like: T) -> T:
    """`restored` with each Flax NNX object that `like` holds at several places (a layer used
    twice: tied weights) one object again. JAX's pytree view of NNX objects, through which
    `restored` was read, copies such an object at each place; NNX's own graph keeps it one:
    `like`'s NNX objects are cloned together and given the restored values."""
    node = getattr(sys.modules.get("flax.nnx"), "Pytree", None)  # looked up, never imported
    if not isinstance(node, type):
        return restored
    nnx = sys.modules["flax.nnx"]

    def objects(tree: Any) -> tuple[Any, ...]:
        return tuple(
            x for x in jax.tree.leaves(tree, is_leaf=node.__instancecheck__) if isinstance(x, node)
        )

    mine = objects(like)
    if not mine:
        return restored
    copies = nnx.clone(mine)
    nnx.update(copies, nnx.state(objects(restored)))
    each = iter(copies)
    return jax.tree.map(
        lambda x: next(each) if isinstance(x, node) else x, restored, is_leaf=node.__instancecheck__
    )


_STATE_INVERSE = re.compile(r"\.scale_inv(\.value)?$")


def _target(saved: dict[str, Any], like: T) -> T:
    """`like`, or, for a checkpoint written before `TensorState` kept `scale_inv` (its record
    names no such leaf), `like` with each such state as that checkpoint holds it; either with
    each Python number that the checkpoint holds as a 0-d array of its kind (a train state's
    step, built as `0` and saved after a step) as such an array, to be restored as one."""
    like = jax.tree_util.tree_map_with_path(
        lambda path, x: _as_saved(saved.get("leaves", {}).get(jax.tree_util.keystr(path)), x),
        like,
    )
    # A state's leaf `.scale_inv`, or `.scale_inv.value` where a Flax NNX variable holds it.
    if any(_STATE_INVERSE.search(where) for where in saved.get("leaves", {})):
        return like
    return as_stored(like)


#: The NumPy kinds of the 0-d arrays a Python number of each type may be restored from.
_KINDS = {bool: "b", int: "iu", float: "f", complex: "c"}


def _as_saved(entry: list | None, leaf: Any) -> Any:
    """`leaf`, or, a Python number where the checkpoint's record (`entry`) has a 0-d array of
    its kind, a zero array of that dtype in its place; a NumPy array of a subclass (JAX's
    literals: a Linen layer's state initialised under `nn.remat`) as a plain one, the type a
    restored NumPy leaf has."""
    if isinstance(leaf, np.ndarray) and type(leaf) is not np.ndarray:
        return np.asarray(leaf)
    kinds = _KINDS.get(type(leaf))
    if kinds is None or entry is None or len(entry) != 2 or entry[0]:
        return leaf
    dtype = np.dtype(entry[1])
    return jnp.zeros((), dtype) if dtype.kind in kinds else leaf


def _numpy_reads_back(dtype: np.dtype) -> bool:
    """Whether `np.load` reads an array of `dtype` back in that dtype: not bfloat16 and the
    FP8 dtypes (`ml_dtypes`), which `np.save` writes as raw bytes or, `float8_e5m2`, as a
    dtype NumPy cannot read back."""
    try:
        return np.dtype(np.lib.format.dtype_to_descr(dtype)) == dtype
    except (TypeError, ValueError):
        return False


def _serialise(f: Any, x: Any) -> None:
    """Equinox's serialisation, with arrays of dtypes NumPy does not read back (bfloat16,
    FP8) written as raw bytes, which `_deserialise` views in `like`'s dtype."""
    if eqx.is_array(x) and not _numpy_reads_back(np.dtype(x.dtype)):
        x = np.asarray(x)
        x = x.view(np.dtype(f"V{x.dtype.itemsize}"))
    eqx.default_serialise_filter_spec(f, x)


def _deserialise(f: Any, like: Any) -> Any:
    """A leaf read back with `like`'s sharding if `like` is a `jax.Array` (Equinox's default
    would put it on the default device: a process-local array, in a multi-process run); a
    NumPy array in its dtype."""
    if isinstance(like, np.ndarray):
        value = np.load(f)
        return value.view(like.dtype) if value.dtype.kind == "V" else value
    if not isinstance(like, jax.Array | jax.ShapeDtypeStruct):
        return eqx.default_deserialise_filter_spec(f, like)
    value = np.load(f)
    if value.dtype.kind == "V":  # NumPy saves bfloat16 and FP8 dtypes as raw bytes
        value = value.view(like.dtype)
    return placed_as(value, like)


def _as_path(path: Any, who: str) -> pathlib.Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{who}: path={path!r} should be a str or an os.PathLike.")
    return pathlib.Path(path).expanduser()  # `~/ckpt` in the home directory, not `./~/ckpt`


def _check_savable(state: Any) -> None:
    """Raise `ValueError` before writing if `state` has arrays a checkpoint cannot hold:
    objects, strings, structured records (NumPy's kinds O, U, S and V). bfloat16 and the FP8
    dtypes are kind V in NumPy too, and are numbers: saved (as raw bytes by NumPy, read back
    in `like`'s dtype)."""
    for where, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not eqx.is_array(leaf):
            continue
        dtype = np.dtype(leaf.dtype)
        if dtype.kind in "OUSV" and not jnp.issubdtype(dtype, jnp.number):
            raise ValueError(
                f"save_checkpoint: leaf {jax.tree_util.keystr(where) or 'at the root'} is an "
                f"array of dtype {dtype}; a checkpoint holds numeric arrays only."
            )


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}: should be one of {list(_BACKENDS)}.")


def _orbax():
    try:
        import orbax.checkpoint as ocp  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        raise ImportError(
            "backend='orbax' needs orbax-checkpoint: pip install 'fp8jax[orbax]'."
        ) from e
    quiet_orbax_leftovers()  # before a restore: its leftover reads can report at any time
    return ocp


def _orbax_record(path: pathlib.Path) -> bytes:
    """The record of the orbax checkpoint at `path`, or an error that says what `path` is."""
    if path.is_file():
        raise NotADirectoryError(
            f"load_checkpoint: {os.fspath(path)!r} is a file; backend='orbax' reads the "
            "directory save_checkpoint(..., backend='orbax') wrote (the Equinox backend's "
            "checkpoints are files: backend='equinox')."
        )
    if not path.is_dir():
        raise _no_checkpoint(path, "orbax")
    if not (path / _RECORD).is_file():
        raise ValueError(
            f"{os.fspath(path)!r} is not an fp8jax checkpoint (a directory without "
            f"{_RECORD}); write one with fp8jax.save_checkpoint(..., backend='orbax')."
        )
    magic = (path / _FORMAT).read_bytes() if (path / _FORMAT).is_file() else MAGIC
    check_format(magic, path, _FORMAT)
    return (path / _RECORD).read_bytes()


def _no_checkpoint(path: pathlib.Path, backend: str) -> FileNotFoundError:
    """The error for nothing at `path`, naming what a save to it stopped half-way left beside
    it (an orbax save's `<path>.tmp` and `<path>.old`, an Equinox save's temporary file),
    which is which, and which to rename to `path`."""
    at = repr(os.fspath(path))
    new, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    orbax = ", written with backend='orbax'" if backend != "orbax" else ""
    left = []
    if (new / _RECORD).is_file():
        left.append(
            f"{os.fspath(new)!r} (the new checkpoint that save wrote, complete{orbax}: rename "
            f"it to {at} to restore it)"
        )
    elif new.is_dir():
        left.append(f"{os.fspath(new)!r} (the new checkpoint that save was writing, incomplete)")
    if (old / _RECORD).is_file():
        left.append(
            f"{os.fspath(old)!r} (the previous checkpoint, complete{orbax}: rename it to {at} "
            "to restore it)"
        )
    for tmp in sorted(path.parent.glob(glob.escape(path.name) + ".*.tmp")):
        if tmp.is_file():
            left.append(
                f"{os.fspath(tmp)!r} (a file a save was writing, killed before its rename: "
                f"rename it to {at} and load it; one cut short is refused as truncated)"
            )
    found = f" A save to it stopped half-way left {'; '.join(left)}." if left else ""
    return FileNotFoundError(f"load_checkpoint: no checkpoint at {at}.{found}")


def _check_replaceable(path: pathlib.Path) -> None:
    """An orbax save replaces the directory at `path` whole: only a checkpoint it wrote."""
    if path.exists() and not (path.is_dir() and (path / _RECORD).is_file()):
        raise FileExistsError(
            f"save_checkpoint: {os.fspath(path)!r} is "
            f"{'a directory that is not an' if path.is_dir() else 'a file, not an'} fp8jax "
            "checkpoint; backend='orbax' replaces only a checkpoint it wrote (which holds "
            f"{_RECORD}). Give a new path, or remove what is there."
        )


def _orbax_save(path: pathlib.Path, state: Any, record: bytes) -> None:
    ocp = _orbax()
    tmp = path.with_name(path.name + ".tmp")

    def prepare() -> None:  # before orbax: its threads print tracebacks of what it cannot write
        _check_replaceable(path)
        remove(tmp)
        with naming(path):
            make_parents(path)
            tmp.mkdir()  # a location that cannot be written raises here, naming `path`
            tmp.rmdir()

    on_process_zero("check the checkpoint's path", prepare)
    arrays = eqx.filter(state, eqx.is_array)

    def finish() -> None:
        for name, data in ((_FORMAT, MAGIC), (_RECORD, record)):
            with open(tmp / name, "wb") as f:
                f.write(data)
                sync_file(f)
        sync_directory(tmp)
        replace_directory(tmp, path)

    # With several processes, all of them write shards into `tmp` (orbax coordinates them);
    # only process 0 touches the directories around it.
    try:
        save_arrays(ocp, tmp.absolute() / "state", arrays)
        on_process_zero("write the checkpoint", finish)
    except Exception:  # a failed save leaves no half-written `<path>.tmp` behind (a killed one
        if jax.process_index() == 0:  # leaves it, and `load_checkpoint` names it)
            shutil.rmtree(tmp, ignore_errors=True)  # (the save's own error is the one raised)
        raise


def _orbax_load(path: pathlib.Path, like: T) -> T:
    ocp = _orbax()
    arrays, static = eqx.partition(like, is_array_like)
    check_restorable(ocp, arrays)  # outside the try: not a half-written checkpoint
    try:
        restored = restore_arrays(ocp, path.absolute() / "state", arrays)
    except Exception as e:  # noqa: BLE001 - any failure to read the arrays: half-written
        raise corrupt(path, f"its arrays could not be read ({type(e).__name__}: {e})") from e
    restored = jax.tree.map(placed_as, restored, arrays)  # uncommitted where `like` is
    return eqx.combine(restored, static)
