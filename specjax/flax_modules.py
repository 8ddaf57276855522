"""Flax modules over specjax's own parameter trees, for training pipelines.

specjax's models are pure functions of a nested dict of arrays
(:func:`specjax.models.forward`). This module wraps that same function in a Flax NNX
module (:class:`NNXCausalLM`) and a Flax linen module (:class:`LinenCausalLM`) whose
parameter trees *are* specjax's, one leaf for one leaf, with the same names and shapes
(see :mod:`specjax.models.gpt2` and :mod:`specjax.models.decoder` for the layout)::

    nnx.to_pure_dict(nnx.state(module, nnx.Param))  == specjax params   (NNX)
    variables["params"]                             == specjax params   (linen)

so no renaming or copying happens between a Flax training loop and generation, and a
call ``module(tokens, positions, cache, mask)`` runs :func:`specjax.models.forward` on
those arrays: the logits are bit-identical to the function's. Batches are ``jax.vmap``
over the function (tokens ``[B, T]``).

Moving between the two worlds:

* :func:`model_from_flax` turns an NNX module, an ``nnx.State``, linen ``params`` /
  ``variables`` or a ``flax.training.train_state.TrainState`` into a
  :class:`specjax.Model` that :func:`specjax.generate` decodes with every method;
* :func:`to_flax` goes back (an NNX module, or a linen module and its variables),
  sharing the model's arrays;
* :func:`specjax.checkpoints_tools.flax_export.save_for_specjax` writes what a pipeline
  trained as a specjax checkpoint directory (``specjax_config.json`` + orbax ``params/``)
  that :func:`specjax.load` reads (the writing is the loaders', above this module).

Modules keep no state between calls: the KV cache is an argument and a return value.

Two things worth knowing in a pipeline (flax 0.12):

* Inside your own jitted step, call the module through ``nnx.merge(graphdef, state)``
  under ``jax.jit``, or ``nnx.jit(..., graph=False)``: both compile to the same program
  as the function (``benchmarks/experiments/bench_flax_overhead.py``). A default
  ``nnx.jit`` step returns every variable of the module it was given, which copies all the
  weights on each call: for a 135M-parameter model on a CPU, several times a decode
  step. Training steps, which update the weights anyway, do not mind.
* An ``nnx.State`` written by orbax as is stores every leaf as ``{"value": array}``;
  ``specjax.load`` refuses that tree by name. Write checkpoints for specjax with
  ``save_for_specjax`` (or save ``nnx.to_pure_dict(state)`` under ``params/``).
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import linen, nnx

from specjax import models
from specjax.cache import KVCache
from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.loaded_model import Model


def apply_forward(params: dict, config: ModelConfig, tokens: jax.Array,
                  positions: jax.Array | None = None, cache: KVCache | None = None,
                  mask: jax.Array | None = None, scratch_mask: jax.Array | None = None, *,
                  attn_impl: str = "auto") -> tuple[jax.Array, KVCache | None]:
    """:func:`specjax.models.forward` for one sequence or a batch (what the modules call).

    Args:
      params: specjax parameter tree of ``config``.
      config: static model config.
      tokens: int32 [T], or [B, T] for a batch (the function is vmapped over B).
      positions: int32 [T] or [B, T]; default ``cache.length + arange(T)`` (``arange(T)``
        without a cache).
      cache: :class:`~specjax.cache.KVCache`, or ``None`` for a plain causal pass; with
        batched tokens every cache field has a leading B axis.
      mask: bool [T, T] (or [B, T, T]) visibility among the new tokens; ``None`` = causal.
      scratch_mask: optional bool [T, M] (or [B, T, M]), see :func:`specjax.models.forward`.
      attn_impl: ``"auto"``, ``"reference"`` or ``"kernel"`` (static).
    Returns:
      (logits float32 [T, V] or [B, T, V], the cache with the new K/V in its scratch slots,
      or ``None``).
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim not in (1, 2):
        raise InvalidArgumentError(f"tokens must be [T] or [B, T], got shape {tokens.shape}")

    def single(tokens, positions, cache, mask, scratch_mask):
        if positions is None:
            start = 0 if cache is None else cache.length
            positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
        return models.forward(params, config, tokens, positions, cache, mask, scratch_mask,
                              attn_impl=attn_impl)

    if tokens.ndim == 1:
        return single(tokens, positions, cache, mask, scratch_mask)
    axes = (0, _batch_axis(positions, 2), 0, _batch_axis(mask, 3),
            _batch_axis(scratch_mask, 3))
    return jax.vmap(single, in_axes=axes)(tokens, positions, cache, mask, scratch_mask)


def _batch_axis(array, batched_ndim: int):
    return 0 if array is not None and jnp.ndim(array) == batched_ndim else None


# ----------------------------------------------------------------------------- NNX


class _NNXParamGroup(nnx.Module):
    """A nested level of the parameter tree (``layers``): one ``nnx.Param`` per leaf."""

    def __init__(self, arrays: Mapping[str, jax.Array]):
        for name, array in arrays.items():
            setattr(self, name, nnx.Param(array))


class NNXCausalLM(nnx.Module):
    """A GPT-2 or Llama-family model as a Flax NNX module over specjax parameters.

    Every leaf of the specjax parameter tree is an ``nnx.Param`` attribute of the same name
    (``embed``, ``final_norm``, ... and the stacked blocks under ``layers``), so
    ``nnx.to_pure_dict(nnx.state(module, nnx.Param))`` is the specjax tree and an
    ``nnx.Optimizer(module, tx, wrt=nnx.Param)`` trains exactly those arrays.

    Args:
      config: the model's static config (stored as a static attribute).
      rngs: ``nnx.Rngs`` for a random initialisation (:func:`specjax.models.init_params`
        with ``rngs.params()``); ignored when ``params`` is given.
      params: an existing specjax parameter tree to wrap (checked against ``config``;
        jax arrays are shared, not copied).
      dtype: dtype of a random initialisation.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None,
                 params: Mapping | None = None, dtype=jnp.float32):
        if params is None:
            if rngs is None:
                raise InvalidArgumentError("NNXCausalLM needs rngs= (random init) or params=")
            params = models.init_params(config, rngs.params(), dtype)
        else:
            if models.HEAD_SUBSET in params:
                raise InvalidArgumentError(
                    "parameters with a head subset are a decoding-only view: wrap the full "
                    "parameters and call Model.with_head_subset after decoding them")
            models.check_params(config, params, source="params")
        self.config = config
        for name, value in params.items():
            if isinstance(value, Mapping):
                setattr(self, name, _NNXParamGroup(
                    {k: jnp.asarray(v) for k, v in value.items()}))
            else:
                setattr(self, name, nnx.Param(jnp.asarray(value)))

    @property
    def params(self) -> dict:
        """The specjax parameter tree (a nested dict of this module's ``Param`` values)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 cache: KVCache | None = None, mask: jax.Array | None = None,
                 scratch_mask: jax.Array | None = None, *, attn_impl: str = "auto"):
        """Runs :func:`specjax.models.forward` on this module's parameters.

        Args and Returns: as :func:`apply_forward` (tokens [T] or [B, T]; logits float32
        [T, V] or [B, T, V] and the cache with the new K/V in its scratch slots).
        """
        return apply_forward(self.params, self.config, tokens, positions, cache, mask,
                             scratch_mask, attn_impl=attn_impl)


# ----------------------------------------------------------------------------- linen


def _leaf_initializer(name: str):
    """The initializer rule of :func:`specjax.models.init_params` for one leaf name."""
    if name.endswith(("norm", "scale")):
        return linen.initializers.ones
    if name.startswith("b") or name.endswith("bias"):
        return linen.initializers.zeros
    return linen.initializers.normal(stddev=0.02)


def _declare_linen(module: linen.Module, shapes: Mapping, dtype) -> dict:
    params = {}
    for name, shape in shapes.items():
        if isinstance(shape, Mapping):
            params[name] = _LinenParamGroup(tuple(shape.items()), dtype, name=name)()
        else:
            params[name] = module.param(name, _leaf_initializer(name), shape, dtype)
    return params


class _LinenParamGroup(linen.Module):
    """A nested level of the parameter tree (``layers``) as a linen scope."""

    shapes: tuple  # ((name, shape), ...): hashable, as linen attributes should be
    dtype: Any

    @linen.compact
    def __call__(self) -> dict:
        return _declare_linen(self, dict(self.shapes), self.dtype)


class LinenCausalLM(linen.Module):
    """A GPT-2 or Llama-family model as a Flax linen module over specjax parameters.

    ``module.init(key, tokens)["params"]`` is a specjax parameter tree of ``config``
    (same leaf names, nesting and shapes; initialised like
    :func:`specjax.models.init_params`), and ``module.apply({"params": params}, tokens,
    positions, cache, mask)`` runs :func:`specjax.models.forward` on it.

    Attributes:
      config: the model's static config.
      param_dtype: dtype of freshly initialised parameters.
      attn_impl: ``"auto"``, ``"reference"`` or ``"kernel"``.
    """

    config: ModelConfig
    param_dtype: Any = jnp.float32
    attn_impl: str = "auto"

    @linen.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 cache: KVCache | None = None, mask: jax.Array | None = None,
                 scratch_mask: jax.Array | None = None):
        """Args and Returns: as :func:`apply_forward` (tokens [T] or [B, T]; logits
        float32 [T, V] or [B, T, V] and the cache with the new K/V in its scratch slots)."""
        params = _declare_linen(self, models.param_shapes(self.config), self.param_dtype)
        return apply_forward(params, self.config, tokens, positions, cache, mask,
                             scratch_mask, attn_impl=self.attn_impl)


# ----------------------------------------------------------------------------- conversion


def flax_params(source: Any, config: ModelConfig | None = None) -> tuple[ModelConfig, dict]:
    """(config, specjax parameter tree) of a Flax model or training state.

    Args:
      source: an :class:`NNXCausalLM`; an ``nnx.State`` of one (``nnx.state(module)``);
        a ``(LinenCausalLM, variables)`` pair; a linen ``TrainState`` (its ``params``;
        the config is read from ``apply_fn`` when it is a ``LinenCausalLM``'s); linen
        ``variables`` (``{"params": tree}``) or a bare specjax parameter tree.
      config: the model config; needed when ``source`` does not carry one, and checked
        against it when it does.
    Returns:
      (config, params): params is the nested dict of arrays (shared, not copied), checked
      against the config.
    Raises:
      InvalidArgumentError: the config is missing or contradicts the source's.
      CheckpointError: the tree does not match the config (names the first bad leaf).
    """
    own_config = None
    if isinstance(source, NNXCausalLM):
        own_config, params = source.config, source.params
    elif isinstance(source, nnx.State):
        params = nnx.to_pure_dict(source)
    elif isinstance(source, nnx.Module):
        raise InvalidArgumentError(
            f"{type(source).__name__} is not an NNXCausalLM: pass nnx.state(module) of a "
            "module whose Params follow the specjax tree, with config=")
    elif isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], LinenCausalLM):
        own_config, params = source[0].config, _unwrap_variables(source[1])
    elif isinstance(source, LinenCausalLM):
        raise InvalidArgumentError(
            "a linen module holds no parameters: pass (module, variables) or the params")
    elif hasattr(source, "params") and hasattr(source, "apply_fn"):  # linen TrainState
        params = _unwrap_variables(source.params)
        owner = getattr(source.apply_fn, "__self__", None)
        if isinstance(owner, LinenCausalLM):
            own_config = owner.config
    elif isinstance(source, Mapping):
        params = _unwrap_variables(source)
    else:
        raise InvalidArgumentError(
            f"cannot read specjax parameters from a {type(source).__name__}: pass an "
            "NNXCausalLM, an nnx.State, linen params/variables or a TrainState")
    if own_config is not None and config is not None and own_config != config:
        raise InvalidArgumentError(
            "config= differs from the config the Flax module was built with")
    config = config or own_config
    if config is None:
        raise InvalidArgumentError(
            f"a {type(source).__name__} carries no model config: pass config=")
    params = dict(params)
    models.check_params(config, params, source="flax parameters")
    return config, params


def _unwrap_variables(tree: Mapping) -> dict:
    """linen ``variables`` -> their ``params`` collection; a params tree stays as it is."""
    if set(tree) == {"params"} and isinstance(tree["params"], Mapping):
        return dict(tree["params"])
    return dict(tree)


def model_from_flax(source: Any, config: ModelConfig | None = None, tokenizer: Any = None,
                    name: str = "flax-model", dtype=None):
    """A :class:`specjax.Model` over the parameters of a Flax model or training state.

    The result decodes with every method of :func:`specjax.generate` (as a target or as
    a draft); its parameters are the source's arrays (no copy unless ``dtype`` casts).

    Args:
      source, config: see :func:`flax_params`.
      tokenizer: a transformers tokenizer for string prompts, or ``None``.
      name: the model's name.
      dtype: cast the parameters (e.g. ``"bf16"``); ``None`` keeps them.
    Returns:
      A :class:`specjax.Model`.
    """
    config, params = flax_params(source, config)
    return Model.from_params(config, params, tokenizer, name=name, dtype=dtype)


def to_flax(model, api: str = "nnx"):
    """A Flax view of a :class:`specjax.Model`, sharing its arrays.

    Args:
      model: a :class:`specjax.Model` (with its full head: a head subset is a
        decoding-only view).
      api: ``"nnx"`` or ``"linen"``.
    Returns:
      ``"nnx"``: an :class:`NNXCausalLM`; ``"linen"``: ``(LinenCausalLM(config),
      {"params": params})`` ready for ``module.apply(variables, tokens, ...)``.
    """
    if models.HEAD_SUBSET in model.params:
        raise InvalidArgumentError(
            f"model {model.name!r} has a head subset (a decoding-only view): convert the "
            "model it was made from")
    if api == "nnx":
        module = NNXCausalLM(model.config, params=model.params)
    elif api == "linen":
        module = LinenCausalLM(model.config)
    else:
        raise InvalidArgumentError(f"unknown Flax api {api!r}; expected 'nnx' or 'linen'")
    if model.tokenizer is not None:
        try:
            _TOKENIZERS[module] = model.tokenizer  # save_for_specjax keeps it
        except TypeError:  # a module that cannot be weakly referenced: pass tokenizer=
            pass
    return module if api == "nnx" else (module, {"params": dict(model.params)})


# The tokenizer of the model each module of to_flax was made from (the module does not hold
# it: a Flax module carries arrays and static config only), for save_for_specjax.
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_of(source: Any) -> Any:
    """The tokenizer of the model :func:`to_flax` made ``source`` from, or ``None``."""
    try:
        return _TOKENIZERS.get(source)
    except TypeError:  # not weak-referenceable (a dict of params): nothing recorded
        return None
