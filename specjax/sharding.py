"""Sharding a model over a device mesh: tensor parallel over ``model``, batch over ``data``.

A specjax mesh is a :class:`jax.sharding.Mesh` with two axes, ``("data", "model")``
(:func:`make_mesh`). What goes where:

* **Parameters** (:func:`param_specs`): attention is split by head over ``model`` -- the
  q/k/v projections by output column (whole heads: ``[L, d, H*D]`` columns are head-major),
  the output projection ``wo [L, H*D, d]`` by row, their biases alike -- and the MLP's
  up/gate (GPT-2: ``w_fc``) columns and down (``w_proj``) rows likewise. Embeddings, the
  head, position tables and norms are replicated (they are a small share of the weights of
  the models specjax targets, and a vocabulary rarely divides a mesh axis). Every
  parameter is replicated over ``data``.
* **KV caches** (:func:`cache_spec`): ``[L, S, K, D]`` split by KV head over ``model``; a
  batch program's ``[B, L, S, K, D]`` also by row over ``data``.
* **Inputs** (:func:`place_arguments`): a batch's per-row arrays (prompts, lengths,
  budgets, seeds, stop tokens) are split by row over ``data`` when B divides by its size
  (data parallel: each ``data`` group decodes B/data rows on its own copy of the model,
  itself split over ``model``); everything else (sampling settings, n-gram tables) is
  replicated. A draft is used as placed (:func:`shard_model`: split like the target, or
  ``replicate=True``); one on no mesh is replicated at each call.
* **Several processes**: batch programs return the state the host reads (tokens,
  lengths, counts; not the caches) replicated (:func:`readable_by_every_process`).

Each device then holds ``H/m`` query heads, ``K/m`` KV heads and ``F/m`` MLP columns
(``m`` = the ``model`` axis size). The heads of a GQA group stay on one device because a
shard holds ``H/m = G * K/m`` consecutive query heads and the ``K/m`` KV heads they read.
So ``num_heads``, ``num_kv_heads`` and ``intermediate_size`` must divide by ``m``: a model
that does not is refused with a one-line :class:`~specjax.errors.InvalidArgumentError`
naming the parameter and the sizes (:func:`check_divisible`).

Nothing else changes: :func:`specjax.decode.compiled` compiles the same program with the
placed arrays (their shardings are part of the program's key), and XLA's partitioner
inserts the collectives (an all-reduce after ``wo`` and after the MLP's down projection).
Compilation runs with the mesh as JAX's context mesh (:func:`tracing`), which lets two
things inside the program see it: the caches are constrained to :func:`cache_spec` where
they are created (:func:`constrain_cache`), and the Pallas attention kernels, which XLA
cannot partition, run once per shard under ``shard_map`` (:func:`attention_per_shard`).

Tensor parallel changes the order of the sums split over ``model`` (each device adds its
share, then an all-reduce adds the shares), so logits can differ from a single device's
in the last bits; tokens match unless two candidates tie to within that rounding
(``tests/test_sharding.py`` checks token equality on random models).

Several hosts: call :func:`jax.distributed.initialize` in every process before anything
else touches JAX, then build the mesh over ``jax.devices()`` (every process's devices)
and run the same calls in every process (see the README section "Multiple devices and
hosts" and ``tests/test_multihost.py``). Arrays are placed with
:func:`jax.make_array_from_callback`, so each process only writes its own devices' shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError

DATA = "data"
MODEL = "model"
AXES = (DATA, MODEL)

# Parameters split over ``model``, by family: name -> (axis of the stacked [L, ...] array,
# what its split axis counts, for errors). Columns of [L, d, X] are axis 2, rows of
# [L, X, d] axis 1, biases [L, X] axis 1. Everything not named is replicated.
_HEADS, _KV_HEADS, _MLP = "num_heads", "num_kv_heads", "intermediate_size"
_SHARED = "shared_expert_size"
_SPLIT = {
    "llama": {"wq": (2, _HEADS), "bq": (1, _HEADS), "wk": (2, _KV_HEADS),
              "bk": (1, _KV_HEADS), "wv": (2, _KV_HEADS), "bv": (1, _KV_HEADS),
              "wo": (1, _HEADS), "w_gate": (2, _MLP), "b_gate": (1, _MLP),
              "w_up": (2, _MLP), "b_up": (1, _MLP), "w_down": (1, _MLP),
              # experts [L, E, d, F] and [L, E, F, d]: each expert split like the MLP
              "we_gate": (3, _MLP), "we_up": (3, _MLP), "we_down": (2, _MLP),
              "ws_gate": (2, _SHARED), "ws_up": (2, _SHARED), "ws_down": (1, _SHARED)},
    "gpt2": {"wq": (2, _HEADS), "bq": (1, _HEADS), "wk": (2, _KV_HEADS),
             "bk": (1, _KV_HEADS), "wv": (2, _KV_HEADS), "bv": (1, _KV_HEADS),
             "wo": (1, _HEADS), "w_fc": (2, _MLP), "b_fc": (1, _MLP), "w_proj": (1, _MLP)},
}
_FUSED = ("w_qkv", "b_qkv", "w_gate_up", "b_gate_up")


# ----------------------------------------------------------------------------- meshes


def make_mesh(model: int | None = None, data: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("data", "model")`` mesh over ``devices`` (default: ``jax.devices()``, every
    process's devices).

    Args:
      model: devices per tensor-parallel group; default: ``len(devices) // data``.
      data: tensor-parallel groups (batch rows are split over them).
      devices: the devices, in the order the mesh lays them out (row-major:
        consecutive devices share a ``model`` group).
    Returns:
      A :class:`jax.sharding.Mesh` of shape ``(data, model)``.
    Raises:
      InvalidArgumentError: sizes that are not positive or do not multiply to the number
        of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (("data", data), ("model", model)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise InvalidArgumentError(f"mesh axis {name!r} must be a positive integer, "
                                       f"got {value!r}")
    if model is None:
        if len(devices) % data:
            raise InvalidArgumentError(f"mesh axis 'data' ({data}) does not divide the "
                                       f"{len(devices)} devices")
        model = len(devices) // data
    if data * model != len(devices):
        raise InvalidArgumentError(
            f"a mesh of data={data} x model={model} needs {data * model} devices, "
            f"got {len(devices)}")
    return Mesh(np.array(devices, dtype=object).reshape(data, model), AXES)


def check_mesh(mesh) -> Mesh:
    """``mesh`` if it is a :class:`Mesh` with exactly the axes ``("data", "model")``, with
    every axis of type ``Auto``; raises :class:`InvalidArgumentError` otherwise.

    A mesh from ``jax.make_mesh`` has ``Explicit`` axes by default (explicit sharding,
    where a sharding constraint asserts instead of placing): specjax places arrays
    itself, so the same devices and axes come back as an ``Auto`` mesh."""
    if not isinstance(mesh, Mesh):
        raise InvalidArgumentError(f"mesh must be a jax.sharding.Mesh (see "
                                   f"specjax.sharding.make_mesh), got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != AXES:
        raise InvalidArgumentError(f"mesh axes must be {AXES}, got {tuple(mesh.axis_names)} "
                                   f"(see specjax.sharding.make_mesh)")
    types = tuple(getattr(mesh, "axis_types", None) or ())
    auto = jax.sharding.AxisType.Auto
    if any(kind != auto for kind in types):
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(AXES))
    return mesh


def axis_size(mesh, axis: str) -> int:
    """Devices along ``axis`` of a (concrete or abstract) mesh; 1 when it has no such axis."""
    if mesh is None or getattr(mesh, "empty", False) or axis not in mesh.axis_names:
        return 1
    return int(dict(mesh.shape)[axis])


def mesh_of(tree) -> Mesh | None:
    """The mesh the arrays of ``tree`` are placed on with a :class:`NamedSharding`, or
    ``None`` (single device, numpy, or nothing placed)."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


# ----------------------------------------------------------------------------- parameters


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_divisible(config: ModelConfig, mesh) -> None:
    """Raises :class:`InvalidArgumentError` (one line, naming the parameter and the sizes)
    when a split dimension of ``config`` does not divide the mesh's ``model`` axis."""
    size = axis_size(mesh, MODEL)
    if size == 1:
        return
    for name, (_, counts) in _SPLIT[config.architecture].items():
        value = getattr(config, counts)
        if value % size:
            raise InvalidArgumentError(
                f"cannot shard parameter layers/{name} over mesh axis 'model' of size {size}: "
                f"{counts}={value} is not a multiple of {size}; choose a 'model' size "
                f"that divides it (or replicate the model)")


def param_specs(config: ModelConfig, params: dict, mesh=None) -> dict:
    """The :class:`PartitionSpec` of every parameter (same tree as ``params``).

    Args:
      config: the model's config.
      params: its parameter tree (arrays or anything with ``.ndim``/``.shape``).
      mesh: the mesh, to check divisibility (:func:`check_divisible`); ``None``: no check.
    Raises:
      InvalidArgumentError: a split that does not divide the ``model`` axis; fused
        projections (their concatenated columns do not split by head).
    """
    if mesh is not None:
        check_divisible(config, mesh)
    split = _SPLIT[config.architecture]

    def spec(path, leaf):
        keys = [getattr(k, "key", None) for k in path]
        if len(keys) == 2 and keys[0] == "layers":
            if keys[1] in _FUSED and axis_size(mesh, MODEL) > 1:
                raise InvalidArgumentError(
                    f"parameter layers/{keys[1]} holds fused projections, which do not "
                    f"split by head over 'model': shard the separate layout "
                    f"(specjax.models.unfuse_projections)")
            if keys[1] in split:
                axis, _ = split[keys[1]]
                parts = [None] * np.ndim(leaf)
                parts[axis] = MODEL
                return P(*parts)
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def place(value, sharding: NamedSharding) -> jax.Array:
    """``value`` (numpy or jax, the same full value in every process) as a global array
    with ``sharding``; each process writes only its own devices' shards."""
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(config: ModelConfig, params: dict, mesh: Mesh, *,
                 replicate: bool = False) -> dict:
    """``params`` placed on ``mesh``: split per :func:`param_specs`, or every parameter
    whole on every device (``replicate=True``, e.g. a small draft)."""
    mesh = check_mesh(mesh)
    specs = (jax.tree.map(lambda _: P(), params) if replicate
             else param_specs(config, params, mesh))
    return jax.tree.map(lambda a, s: place(a, NamedSharding(mesh, s)), params, specs)


def shard_model(model, mesh: Mesh, *, replicate: bool = False):
    """A copy of ``model`` (:class:`specjax.Model`) with its parameters on ``mesh`` (see
    :func:`shard_params`); :func:`specjax.generate` then runs sharded."""
    return dataclasses.replace(model, params=shard_params(model.config, model.params, mesh,
                                                          replicate=replicate))


def replicate_onto(tree, mesh: Mesh):
    """Every array leaf of ``tree`` replicated on ``mesh``, except leaves already placed on
    it (whatever their spec: a draft sharded with :func:`shard_model` stays so)."""
    replicated = NamedSharding(mesh, P())

    def one(leaf):
        if leaf is None:
            return None
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return leaf
        return place(leaf, replicated)

    return jax.tree.map(one, tree)


def place_arguments(args: tuple, rows: int | None = None) -> tuple:
    """``args = (params, *rest)`` of a generation program with ``rest`` (prompt, lengths,
    sampling settings, stop tokens, resources) placed on the mesh of ``params``; unchanged
    when ``params`` are on no mesh. Needed with several processes (every argument of a
    program over a global mesh must be a global array).

    Args:
      args: the program's arguments, ``args[-1]`` its method's resources.
      rows: a batch program's row count B: arrays of the per-row arguments with a leading
        axis B are split over ``data`` (when B divides by it), so each ``data`` group
        decodes its own rows. Everything else is replicated.
    """
    mesh = mesh_of(args[0])
    if mesh is None:
        return args
    placed = replicate_onto(args, mesh)
    if rows is None or rows % axis_size(mesh, DATA) or axis_size(mesh, DATA) == 1:
        return placed
    by_row = NamedSharding(mesh, P(DATA))

    def split(leaf):
        if np.ndim(leaf) and np.shape(leaf)[0] == rows:
            return place(leaf, by_row)
        return leaf

    return (placed[0], *jax.tree.map(split, placed[1:-1]), placed[-1])


def batch_axis(rows: int) -> str | None:
    """The mesh axis a batch of ``rows`` is split over while tracing (``jax.vmap``'s
    ``spmd_axis_name``): ``"data"`` when a mesh with a ``data`` axis dividing ``rows`` is
    active, else ``None``. Constraints and ``shard_map`` inside the vmapped row program
    then keep each row on its ``data`` group."""
    mesh = active_mesh()
    size = axis_size(mesh, DATA)
    return DATA if mesh is not None and size > 1 and rows % size == 0 else None


# ----------------------------------------------------------------------------- inside programs


def tracing(mesh: Mesh | None):
    """Context for tracing a program whose arguments live on ``mesh``: makes it JAX's
    context mesh (:func:`jax.set_mesh`) so that :func:`constrain_cache` and
    :func:`attention_per_shard` see it. No-op for ``None``."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def active_mesh():
    """The context mesh while tracing under :func:`tracing`, or ``None``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or MODEL not in mesh.axis_names:
        return None
    return mesh


def readable_by_every_process(state, keep: tuple[str, ...] = ("cache",)):
    """``state`` (a flax struct) with every field but ``keep`` constrained to be
    replicated, when tracing over a mesh that spans several processes; unchanged
    otherwise. A batch split by row over ``data`` leaves each process only its own rows'
    tokens and counts, and the host reads every row: the fields it reads are small (the
    caches, kept split, are not read)."""
    mesh = active_mesh()
    if mesh is None or jax.process_count() == 1:
        return state
    replicated = NamedSharding(mesh, P())
    kept = {name: getattr(state, name) for name in keep}
    small = state.replace(**dict.fromkeys(keep))
    small = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), small)
    return small.replace(**kept)


def cache_spec(ndim: int) -> P:
    """The spec of a K or V cache array with ``ndim`` dims, ``[L, S, K, D]`` (or one
    layer's ``[S, K, D]``): split by KV head over ``model``. A batch program's leading row
    axis goes over ``data`` through ``jax.vmap(..., spmd_axis_name="data")``
    (:func:`batch_axis`)."""
    parts = [None] * ndim
    parts[-2] = MODEL
    return P(*parts)


def constrain_cache(cache, config: ModelConfig):
    """``cache`` (a :class:`~specjax.cache.KVCache`) constrained to :func:`cache_spec`
    when tracing over a mesh; unchanged otherwise, or when ``config``'s KV heads do not
    divide the ``model`` axis."""
    mesh = active_mesh()
    if mesh is None or config.num_kv_heads % axis_size(mesh, MODEL):
        return cache
    sharding = NamedSharding(mesh, cache_spec(cache.k.ndim))
    return cache.replace(k=jax.lax.with_sharding_constraint(cache.k, sharding),
                         v=jax.lax.with_sharding_constraint(cache.v, sharding))


def _shard_map(fn, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map  # older jax

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def attention_per_shard(kernel: Callable, q, k_new, v_new, k_cache, v_cache, length, mask,
                        scratch_mask=None, *, layer=None, first_visible=None):
    """Runs an attention implementation (``kernel``, with the positional signature of
    :func:`specjax.attention.attention_reference` and ``layer`` and ``first_visible``
    keywords) once per
    ``model`` shard, on that shard's heads, under ``shard_map``; directly when no mesh is
    active or the heads do not divide the ``model`` axis.

    Heads are the second-to-last axis of ``q`` [T, H, D], ``k_new``/``v_new`` [T, K, D] and
    the caches [S, K, D] / [L, S, K, D]; a shard's ``H/m`` query heads are exactly the
    groups of its ``K/m`` KV heads. Lengths, masks, the layer index and the sliding
    window's first visible slots are replicated.
    A Pallas call is opaque to XLA's partitioner, which would otherwise gather every
    head onto every device and run the whole kernel there.
    """
    mesh = active_mesh()
    size = axis_size(mesh, MODEL)
    num_heads, num_kv_heads = q.shape[-2], k_new.shape[-2]
    if size == 1 or num_heads % size or num_kv_heads % size:
        return kernel(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask,
                      layer=layer, first_visible=first_visible)

    def heads(x):
        return None if x is None else cache_spec(x.ndim)

    def body(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask, layer,
             first_visible):
        return kernel(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask,
                      layer=layer, first_visible=first_visible)

    as_array = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    args = (q, k_new, v_new, k_cache, v_cache, as_array(length), mask, scratch_mask,
            as_array(layer), as_array(first_visible))
    specs = tuple(heads(x) if i < 5 else None if x is None else P()
                  for i, x in enumerate(args))
    # shard_map takes no None leaves: close over the absent arguments instead.
    present = [i for i, x in enumerate(args) if x is not None]

    def call(*values):
        full = [None] * len(args)
        for i, value in zip(present, values):
            full[i] = value
        return body(*full)

    mapped = _shard_map(call, mesh, tuple(specs[i] for i in present), heads(q))
    return mapped(*(args[i] for i in present))


def describe(tree) -> dict[str, str]:
    """``{parameter path: spec}`` of the arrays of ``tree`` (for logs and benchmark JSON)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_name(path): str(getattr(leaf.sharding, "spec", "single device"))
            for path, leaf in leaves if hasattr(leaf, "sharding")}
