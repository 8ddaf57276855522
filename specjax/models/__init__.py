"""Model forward functions: pure functions of (params, config, inputs, cache).

One signature serves prefill, one-token decode and tree verification::

    logits, cache = forward(params, config, tokens, positions, cache, mask)

``tokens`` and ``positions`` are [T]; ``mask`` [T, T] says which new tokens each new token
sees (lower-triangular by default, an ancestor mask for trees); every token also sees the
cache's committed slots ``[0, cache.length)``. The new tokens' K/V land in the cache's
scratch slots ``[length, length + T)`` and the cursor does not move: the caller commits
(see :mod:`specjax.cache`). With ``cache=None`` the call is a plain causal forward
(training, parity tests).

Batching is ``jax.vmap`` over this function. Parameters are nested dicts of arrays; each
family module documents its tree and gives ``param_shapes``, which drives
:func:`init_params` and the strict shape check :func:`check_params` used by every loader.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels, sharding
from specjax.attention import attention, matmul_precision
from specjax.cache import KVCache, write_scratch
from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.kernel_options import KernelOptions
from specjax.kernels.layout import round_up
from specjax.models import decoder, gpt2

_FAMILIES = {"llama": decoder, "gpt2": gpt2}


def param_shapes(config: ModelConfig, fused: bool = False) -> dict:
    """Nested dict of parameter shapes for ``config`` (``fused``: with fused projections,
    :func:`fuse_projections`)."""
    family = _FAMILIES[config.architecture]
    if fused:
        if not hasattr(family, "fuse_layers"):
            raise InvalidArgumentError(
                f"{config.architecture} models have no fused-projection layout")
        return family.param_shapes(config, fused=True)
    return family.param_shapes(config)


def num_params(config: ModelConfig) -> int:
    """Number of parameters of ``config`` (the embedding counted once when the head is
    tied)."""
    return sum(math.prod(shape) for shape in _shape_leaves(param_shapes(config)))


def _shape_leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _shape_leaves(value)
    else:
        yield tree


def projections_fused(params: dict) -> bool:
    """Whether ``params`` holds fused projections (:func:`fuse_projections`)."""
    return any(name in params.get("layers", {}) for name in ("w_qkv", "w_gate_up"))


def fuse_projections(config: ModelConfig, params: dict) -> dict:
    """``params`` with each layer's q|k|v and gate|up matrices (and biases) concatenated
    along their output axis: one matmul instead of three, and two, per layer.

    Call it once, outside ``jit`` (it concatenates every layer's weights: inside a jitted
    step it would copy them every step). :func:`forward` takes either layout; checkpoint
    loaders and exporters use the separate one (:func:`unfuse_projections` restores it
    exactly). Llama family: q|k|v and gate|up; GPT-2: q|k|v.
    """
    family = _FAMILIES[config.architecture]
    if not hasattr(family, "fuse_layers") or projections_fused(params):
        return params
    return {**params, "layers": family.fuse_layers(params["layers"])}


def unfuse_projections(config: ModelConfig, params: dict) -> dict:
    """Inverse of :func:`fuse_projections`: the separate, checkpoint layout."""
    if not projections_fused(params):
        return params
    family = _FAMILIES[config.architecture]
    return {**params, "layers": family.unfuse_layers(config, params["layers"])}


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters: N(0, 0.02) matrices, unit norm scales, zero biases."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), k in zip(leaves, keys):
        name = path[-1].key
        if name == "draft_vocab":  # the map of a reduced head: the first K ids
            out.append(jnp.arange(shape[0], dtype=jnp.int32))
        elif name.endswith(("norm", "scale")):
            out.append(jnp.ones(shape, dtype))
        elif name.startswith("b") or name.endswith("bias"):
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def check_params(config: ModelConfig, params: dict, source: str = "checkpoint") -> None:
    """Raises :class:`CheckpointError` naming the first missing, extra or mis-shaped tensor
    (of the separate layout, or of the fused one when ``params`` holds fused projections)."""
    fused = projections_fused(params) and hasattr(_FAMILIES[config.architecture],
                                                  "fuse_layers")
    expected = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        param_shapes(config, fused), is_leaf=lambda x: isinstance(x, tuple))[0]}
    got = {jax.tree_util.keystr(p): tuple(a.shape)
           for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    for name in expected:
        if name not in got:
            raise CheckpointError(f"{source}: missing parameter {name}")
    for name, shape in got.items():
        if name not in expected:
            raise CheckpointError(f"{source}: unexpected parameter {name}")
        if shape != expected[name]:
            raise CheckpointError(
                f"{source}: parameter {name} has shape {shape}, expected {expected[name]}")


def causal_mask(num_tokens: int) -> jax.Array:
    """bool [T, T] lower-triangular mask."""
    return jnp.tril(jnp.ones((num_tokens, num_tokens), jnp.bool_))


# Attention ``"fused"`` runs the projections through the row-tiled linear kernel for calls
# of at most this many new tokens (decode steps, verify passes, draft levels); longer calls
# (prefill) take the reference layers. Both methods being compared share the prefill.
FUSED_MAX_TOKENS = 128


def has_fused_layers(config: ModelConfig) -> bool:
    """Whether ``config``'s architecture has the fused-kernel layers of attention
    ``"fused"`` (the shared decoder, with every feature its families switch on; GPT-2 has
    none)."""
    return hasattr(_FAMILIES[config.architecture], "block_fused")


def no_fused_layers_reason(config: ModelConfig) -> str:
    """One phrase saying why :func:`has_fused_layers` is false for ``config``."""
    return f"{config.architecture} models have none"


def attention_fallback(config: ModelConfig, platform: str = "cpu") -> str | None:
    """What the attention of ``config`` needs that the Pallas attention kernel of
    ``platform`` lacks, for a run's stats: there attention ``"auto"`` runs the jnp attention
    and ``"kernel"`` refuses. ``platform`` ``"gpu"`` or ``"tpu"`` names that backend's
    kernel; ``"cpu"`` the GPU kernel, which attention ``"kernel"`` interprets there (a CPU's
    ``"auto"`` is the jnp attention by design, for every model, and records nothing). On a
    GPU or TPU a head_dim the kernel does not take is named too. ``None`` when the kernel
    takes the model."""
    variant = platform if platform in ("gpu", "tpu") else "gpu"
    needs = []
    windowed = [name for name, on in (("soft-capping", config.attn_softcap is not None),
                                      ("sliding windows", bool(config.layer_windows))) if on]
    if windowed and not kernels.takes_windows(variant):
        needs += windowed
    if platform in ("gpu", "tpu"):
        kernel = importlib.import_module(f"specjax.kernels.attention_{platform}")
        if config.head_dim not in kernel.HEAD_DIMS:
            needs.append(f"head_dim {config.head_dim}")
    if not needs:
        return None
    return (f"jnp attention: the Pallas attention kernel ({variant}) takes no "
            f"{' or '.join(needs)}")


def uses_fused_layers(config: ModelConfig, num_tokens: int,
                      attn_impl: KernelOptions | str) -> bool:
    """Whether a call over ``num_tokens`` new tokens runs the fused-kernel layers
    (``attn_impl``: :class:`KernelOptions` or an attention implementation's name).

    Then every projection and the head are one :func:`specjax.kernels.fused_linear` call
    each (a projection whose shape the kernel does not take, e.g. a width that is not a
    multiple of 16, runs its jnp reference instead, recorded in the run's
    ``stats["fallbacks"]``) and attention is
    :func:`specjax.kernels.ordered_attention`: a row's arithmetic depends neither on how
    many rows share the call nor on whether its context is committed or in the tree, so a
    verify pass reproduces the one-token steps bit for bit.
    """
    return (KernelOptions.of(attn_impl).attention == "fused" and num_tokens <= FUSED_MAX_TOKENS
            and has_fused_layers(config))


def _record_unfused(config: ModelConfig, num_tokens: int) -> None:
    """Records (:mod:`specjax.kernels.fallbacks`) why a call with ``attn_impl="fused"``
    runs the ``"auto"`` layers: a pass over more than :data:`FUSED_MAX_TOKENS` tokens (a
    long prefill, shared by the methods compared), or a family without fused layers (a
    draft's: the API refuses such a target)."""
    if has_fused_layers(config):
        why = (f"a {num_tokens}-token pass (the fused kernels take at most "
               f"{FUSED_MAX_TOKENS} tokens)")
    else:
        why = no_fused_layers_reason(config)
    # A long prefill is shared by ar; a draft's layers decide no token (the API refuses a
    # target without fused layers)
    kernels.fallbacks.record("fused layers", f"{why}; attention='auto' ran",
                             row_independent=True)


def _packed_attention(family, scratch_mask) -> bool:
    """Whether fused layers may run :func:`_packed_layers` (the kernel check aside): a
    family that has them, no scratch window (drafting calls attend through the split
    kernel), and no tensor-parallel mesh (the packed rows mix query and KV heads on one
    axis, which one head split cannot divide; :func:`sharding.attention_per_shard` runs
    the other layout per shard)."""
    return (hasattr(family, "block_fused_packed")
            and (scratch_mask is None or scratch_mask.shape[1] == 0)
            and sharding.axis_size(sharding.active_mesh(), sharding.MODEL) == 1)


def _packed_layers(family, layers, config: ModelConfig, x, context, packed_shape, k_all,
                   v_all, length, mask, linear, taps, feature_layers: tuple[int, ...],
                   options: KernelOptions, positions):
    """The fused layers with attention reading packed rows
    (:func:`specjax.kernels.ordered_attention_packed`): (x, kv_new [L, 2, rows, K, D],
    ``taps`` with the outputs of blocks ``feature_layers``, :func:`_tap`).

    The loop carries a [L, rows, H + 2K, D] buffer that each layer writes its RoPE'd q|k|v
    rows into (one in-place write) and its attention reads; the chains among the new
    tokens are derived from the mask once, here, not per layer. Each layer's K and V are
    read out of the buffer after the loop, so the cache holds exactly the keys and values
    the chains were read from.
    """
    rows = x.shape[0]
    links, depth = kernels.packed_links(mask, rows)
    context = jax.tree.map(lambda table: jnp.pad(table, ((0, rows - table.shape[0]), (0, 0))),
                           context)

    def attend(packed, index):
        # the layer's window by position (first_visible), its soft-cap
        first = family.layer_attention(config, positions, mask, index)[1].get("first_visible")
        return kernels.ordered_attention_packed(packed, index, k_all, v_all, length, links,
                                                depth, num_heads=config.num_heads,
                                                interpret_variant=options.interpret_variant,
                                                scale=config.query_scale,
                                                softcap=config.attn_softcap,
                                                first_visible=first)

    def packed_layer(carry, _):
        x, index, packed, taps = carry
        rope = family.layer_context(config, context, index)  # NoPE layers: the identity
        x, packed = family.block_fused_packed(layers, index, config, x, rope, packed, attend,
                                              linear, interpret_variant=options.interpret_variant,
                                              gpu_linear=options.gpu_linear,
                                              num_tokens=positions.shape[0])
        if feature_layers:
            taps = _tap(taps, x, index, feature_layers)
        return (x, index + 1, packed, taps), None

    packed = jnp.zeros(packed_shape, x.dtype)
    # Unrolled when the kernels are compiled (a GPU): no loop counter and no loop
    # condition per layer (two launches), and the step's kernels can be captured whole;
    # 30 layers compile in ~6 s for an H100 (4 s as a loop). There the kernels are opaque
    # custom calls and the XLA operations between them elementwise, so unrolling changes
    # no value. Interpreted (CPU tests), the kernels are ordinary XLA operations and
    # unrolled they were not row-independent (a 17-node pass's root logits differed from
    # the one-token step's in the last bit; the loop reproduces them exactly), so the
    # interpreter runs the loop.
    (x, _, packed, taps), _ = jax.lax.scan(packed_layer, (x, jnp.int32(0), packed, taps),
                                           None, length=config.num_layers,
                                           unroll=_kernels_compiled())
    heads = config.num_heads
    kv = packed[:, :, heads:].reshape(*packed.shape[:2], 2, config.num_kv_heads,
                                      config.head_dim)
    return x, kv.transpose(0, 2, 1, 3, 4), taps


# Models of at most this many layers (drafts) run their layers unrolled where the kernels
# are compiled (a GPU or TPU; see _unrolled).
UNROLL_LAYERS_AT_MOST = 4


def _unrolled(config: ModelConfig) -> bool:
    """Whether a small model's (a draft's) layer loop is unrolled: where the kernels are
    compiled, on a GPU a loop costs launches of its own every pass (the loop counter and
    condition per layer, copies of the loop's scalar state), and its kernels are opaque
    custom calls with elementwise operations between them, so unrolling changes no value
    (a draft's numbers never decide a token in any case). Interpreted (the CPU), the loop
    stays: the CPU tests' programs are unchanged."""
    return config.num_layers <= UNROLL_LAYERS_AT_MOST and _kernels_compiled()


def _kernels_compiled() -> bool:
    """Whether this process compiles the Pallas kernels (a GPU or TPU) rather than
    interpreting them (the CPU)."""
    return not kernels.select_variant()[1]


def _tap(taps, x, index, feature_layers: tuple[int, ...]):
    """``taps`` [F, rows, d] with block ``index``'s output ``x`` [rows, d] written into the
    slot of each ``feature_layers`` entry equal to ``index`` (a select per block: the
    layer loop stays one loop, and no [L, rows, d] stack of every block's output is kept)."""
    hit = jnp.asarray(feature_layers, jnp.int32) == index
    return jnp.where(hit[:, None, None], x[None].astype(taps.dtype), taps)


def _join_taps(taps, num_tokens: int):
    """[F, rows, d] -> [T, F*d]: the blocks' outputs side by side, per token."""
    taps = taps[:, :num_tokens]
    return taps.transpose(1, 0, 2).reshape(num_tokens, -1)


def _scratch_offset(scratch_mask, scratch_offset):
    """Where the new tokens' scratch slots start: ``scratch_offset`` (:func:`forward`), or
    after the M slots ``scratch_mask`` [T, M] shows."""
    if scratch_offset is not None:
        return scratch_offset
    return 0 if scratch_mask is None else scratch_mask.shape[1]


def _residual_stream(params, config: ModelConfig, tokens, positions, cache, mask,
                     scratch_mask, attn_impl: KernelOptions | str, features=None,
                     feature_layers: tuple[int, ...] = (), scratch_offset=None):
    """The blocks' output [T, d] before the final norm, the cache with scratch written,
    and the outputs of blocks ``feature_layers`` [T, F*d] (``None`` when there are none)."""
    family = _FAMILIES[config.architecture]
    if any(not 0 <= i < config.num_layers for i in feature_layers):
        raise InvalidArgumentError(f"feature_layers {tuple(feature_layers)} out of range for "
                                   f"a {config.num_layers}-layer model")
    if mask is None:
        mask = causal_mask(tokens.shape[0])
    if config.feature_input:
        if features is None or features.shape != (tokens.shape[0], config.hidden_size):
            raise InvalidArgumentError(
                f"a feature draft needs features [{tokens.shape[0]}, {config.hidden_size}] "
                f"(the target's, one per token), got "
                f"{None if features is None else tuple(features.shape)}")
        x = family.embed(params, config, tokens, positions, features)
    else:
        x = family.embed(params, config, tokens, positions)
    context = family.position_context(config, positions)
    length = None if cache is None else cache.length
    k_all, v_all = (None, None) if cache is None else (cache.k, cache.v)
    options = KernelOptions.of(attn_impl)
    fused = uses_fused_layers(config, tokens.shape[0], options)
    num_taps = len(feature_layers)
    impl = options.attention
    if impl == "fused" and not fused:
        _record_unfused(config, tokens.shape[0])
        impl = "auto"  # a long prefill, or a family without fused layers
    choice = dict(interpret_variant=options.interpret_variant)  # the kernels' variant

    def attend_at(index):
        # Attention reads layer `index` of the whole [L, S, K, D] cache in place: scanning
        # over the cache instead would copy each layer's [S, K, D] slots every step.
        layer_mask, extras = mask, {}
        if hasattr(family, "layer_attention"):  # windows, soft-cap, scale: per layer
            layer_mask, extras = family.layer_attention(config, positions, mask, index)
            if fused and (scratch_mask is None or scratch_mask.shape[1] == 0):
                layer_mask = mask  # ordered kernels: chains, window by first_visible

        def attend(q, k, v):
            return attention(q, k, v, k_all, v_all, length, layer_mask, scratch_mask,
                             impl=impl, layer=None if k_all is None else index, **choice,
                             **extras)
        return attend

    def context_at(index):
        if hasattr(family, "layer_context"):  # local/global RoPE (Gemma 3)
            return family.layer_context(config, context, index)
        return context

    if fused:
        layers = params["layers"]
        # The residual stream at the kernels' row tile for the whole pass: padded here
        # once, not by every projection (a pad before and a slice after each kernel call
        # are launches of their own on a GPU); block_fused keeps the extra rows apart.
        num_tokens = x.shape[0]
        rows = round_up(num_tokens, kernels.linear_row_tile(x.dtype, **choice,
                                                            gpu_linear=options.gpu_linear))
        x = jnp.pad(x, ((0, rows - num_tokens), (0, 0)))
        taps = jnp.zeros((num_taps, rows, config.hidden_size), x.dtype)

        linear = functools.partial(kernels.fused_linear, fallback=True, **choice,
                                   gpu_linear=options.gpu_linear)
        packed_shape = (config.num_layers, rows, config.num_heads + 2 * config.num_kv_heads,
                        config.head_dim)
        if (_packed_attention(family, scratch_mask)
                and kernels.packed_attention_takes(packed_shape, x.dtype, k_all, v_all,
                                                   num_heads=config.num_heads, **choice)):
            x, kv_new, taps = _packed_layers(family, layers, config, x, context,
                                             packed_shape, k_all, v_all, length, mask, linear,
                                             taps, feature_layers, options, positions)
            x, kv_new = x[:num_tokens], kv_new[:, :, :num_tokens]
        else:
            def fused_layer(carry, _):
                x, index, taps = carry
                x, k, v = family.block_fused(layers, index, config, x, context_at(index),
                                             attend_at(index), linear,
                                             interpret_variant=options.interpret_variant)
                if num_taps:
                    taps = _tap(taps, x, index, feature_layers)
                return (x, index + 1, taps), jnp.stack([k, v])

            # No per-layer slices of the weights as scan inputs: the kernels read the
            # stacked [L, ...] weights at the traced index (a slice feeding a custom call
            # is a copy).
            (x, _, taps), kv_new = jax.lax.scan(fused_layer, (x, jnp.int32(0), taps), None,
                                                length=config.num_layers,
                                                unroll=_unrolled(config))
            x = x[:num_tokens]
    else:
        taps = jnp.zeros((num_taps, tokens.shape[0], config.hidden_size), x.dtype)

        def layer(carry, p):
            x, index, taps = carry
            x, k, v = family.block(p, config, x, context_at(index), attend_at(index))
            if num_taps:
                taps = _tap(taps, x, index, feature_layers)
            return (x, index + 1, taps), jnp.stack([k, v])

        (x, _, taps), kv_new = jax.lax.scan(layer, (x, jnp.int32(0), taps), params["layers"],
                                            unroll=_unrolled(config))
    # Each layer's K and V leave the loop as one [2, T, K, D] stack: one in-place write into
    # the loop's output per layer instead of two (on a GPU, one kernel launch each).
    k_new, v_new = kv_new[:, 0], kv_new[:, 1]
    if cache is not None:
        offset = _scratch_offset(scratch_mask, scratch_offset)
        # The write must come after every layer's attention has read the cache, or XLA
        # copies the cache to be free to run them in either order. Through the scan's
        # outputs it does when the layer loop runs; a one-layer loop is inlined, and then
        # nothing orders them: adding 0 * x (x needs every layer's attention) makes the
        # order a data dependence. XLA keeps it (float x * 0 is not folded: NaN and inf
        # give NaN) and optimisation barriers do not survive the CPU pipeline. Exact:
        # k + 0.0 == k; a non-finite x[0, 0] already makes row 0's logits NaN (the target
        # then stops generation; a draft only proposes).
        after = (0.0 * x[0, 0]).astype(k_new.dtype)
        cache = write_scratch(cache, k_new + after, v_new + after, offset)
    return x, cache, (_join_taps(taps, x.shape[0]) if num_taps else None)


def hidden_states(params, config: ModelConfig, tokens, positions, cache: KVCache | None = None,
                  mask=None, scratch_mask=None, *, attn_impl: KernelOptions | str = "auto",
                  features=None, feature_layers: tuple[int, ...] = (),
                  scratch_offset: jax.Array | int | None = None):
    """Final-normed hidden states [T, d] and the cache with scratch slots written.

    These are also the *features* a feature draft reads (``features``: [T, d], required
    when ``config.feature_input``; see :mod:`specjax.training.feature_draft`).
    With ``feature_layers`` (static, block indices) the outputs of those blocks [T, F*d]
    come too, between the two (what a multi-layer feature draft reads,
    ``draft_config.feature_layers``): ``(hidden, layer_features, cache)``.
    ``scratch_offset``: see :func:`forward`."""
    x, cache, taps = _residual_stream(params, config, tokens, positions, cache, mask,
                                      scratch_mask, attn_impl, features, feature_layers,
                                      scratch_offset)
    hidden = _FAMILIES[config.architecture].final_norm(params, config, x)
    if feature_layers:
        return hidden, taps, cache
    return hidden, cache


def fuse_features(params, config: ModelConfig, features: jax.Array) -> jax.Array:
    """The feature [T, d] a feature draft (``config.feature_input``) reads beside each token,
    from the target's features: its layers' outputs [T, F*d] fused by the draft's
    ``feature_fc`` when ``config.feature_layers``, else its final-normed states [T, d]."""
    return _FAMILIES[config.architecture].fuse_features(params, config, features)


HEAD_SUBSET = "head_subset"


def head_subset_params(params: dict, config: ModelConfig, tokens) -> dict:
    """``params`` with a head restricted to ``tokens`` (a draft-only speed-up).

    The subset head computes logits for the given K token ids only, from a gathered copy
    of their K output rows (float32 [K, d] read per pass instead of [V, d]). Every other
    token gets its row's lowest subset logit, so proposals outside the subset (e.g. a
    rare identifier copied by context lookup) stay finite and can still be scored. A
    draft only proposes; exactness never depends on its distribution.
    """
    if config.draft_vocab_size:
        raise InvalidArgumentError("this model's head already scores a reduced vocabulary of "
                                   f"{config.draft_vocab_size} ids (draft_vocab_size)")
    tokens = np.unique(np.asarray(tokens, np.int64))
    if tokens.size == 0 or tokens[0] < 0 or tokens[-1] >= config.vocab_size:
        raise InvalidArgumentError(
            f"head subset tokens must be non-empty ids in [0, {config.vocab_size})")
    table = params["embed"] if config.tie_word_embeddings else params["lm_head"].T
    ids = jnp.asarray(tokens, jnp.int32)
    subset = {"tokens": ids, "weight": jnp.take(jnp.asarray(table), ids, axis=0)}
    if config.head_bias:  # Phi's head bias, for the same ids
        subset["bias"] = jnp.take(jnp.asarray(params["lm_head_bias"]), ids)
    return {**params, HEAD_SUBSET: subset}


def lm_head(params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Logits [T, V] in float32 from hidden states [T, d] (see :func:`head_subset_params`
    for parameter trees with a restricted head)."""
    return finish_logits(config, _head(params, config, hidden))


def finish_logits(config: ModelConfig, logits: jax.Array) -> jax.Array:
    """The head's float32 products as the model's logits: divided by Granite's
    ``logits_divisor``, multiplied by Cohere's ``logit_scale``, soft-capped by Gemma 2's
    ``final_softcap``, else as they are."""
    if config.logits_divisor is not None:
        logits = logits / config.logits_divisor
    if config.logit_scale is not None:
        logits = logits * config.logit_scale
    if config.final_softcap is not None:  # c * tanh(logits / c)
        logits = config.final_softcap * jnp.tanh(logits / config.final_softcap)
    return logits


def _head(params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    precision = matmul_precision(hidden)
    if config.draft_vocab_size:
        # Probability 0 (logit -inf) outside the reduced vocabulary.
        full = jnp.full((hidden.shape[0], config.vocab_size), -jnp.inf, jnp.float32)
        return full.at[:, params["draft_vocab"]].set(draft_logits(params, config, hidden),
                                                     unique_indices=True)
    if HEAD_SUBSET in params:
        subset = params[HEAD_SUBSET]
        logits = jnp.einsum("td,kd->tk", hidden, subset["weight"].astype(hidden.dtype),
                            preferred_element_type=jnp.float32, precision=precision)
        if config.head_bias:  # the subset's rows of Phi's head bias
            logits = logits + subset["bias"].astype(jnp.float32)
        floor = jnp.min(logits, axis=-1, keepdims=True)
        full = jnp.broadcast_to(floor, (hidden.shape[0], config.vocab_size))
        return full.at[:, subset["tokens"]].set(logits, unique_indices=True)
    if config.tie_word_embeddings:
        logits = jnp.einsum("td,vd->tv", hidden, params["embed"].astype(hidden.dtype),
                            preferred_element_type=jnp.float32, precision=precision)
    else:
        logits = jnp.einsum("td,dv->tv", hidden, params["lm_head"].astype(hidden.dtype),
                            preferred_element_type=jnp.float32, precision=precision)
    if config.head_bias:  # Phi's, added to the float32 products
        logits = logits + params["lm_head_bias"].astype(jnp.float32)
    return logits


def cast_floats(tree, dtype):
    """``tree`` with its floating-point leaves cast to ``dtype`` (integer leaves, such as a
    reduced head's ``draft_vocab`` map, unchanged); numpy or jax arrays, inside ``jit`` too
    (where a float32 master copy then gets its gradient through the cast)."""
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)

def draft_logits(params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Logits [T, K] float32 of a reduced-vocabulary head (``config.draft_vocab_size`` K)
    over its own K ids (``params["draft_vocab"]`` maps them to the full vocabulary)."""
    return jnp.einsum("td,kd->tk", hidden, params["draft_head"].astype(hidden.dtype),
                      preferred_element_type=jnp.float32, precision=matmul_precision(hidden))


def forward(params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache | None = None, mask: jax.Array | None = None,
            scratch_mask: jax.Array | None = None, *, attn_impl: KernelOptions | str = "auto",
            features: jax.Array | None = None, return_features: bool = False,
            feature_layers: tuple[int, ...] = (), scratch_offset: jax.Array | int | None = None):
    """Runs the model over T new tokens.

    Args:
      params: parameter tree (see the family modules).
      config: static model config.
      tokens: int32 [T] token ids.
      positions: int32 [T] absolute position ids.
      cache: :class:`KVCache` or ``None``.
      mask: bool [T, T] visibility among the new tokens; ``None`` means causal.
      scratch_mask: optional bool [T, M]: the new tokens also see scratch slot
        ``length + m`` where set, and are written after those M slots (tree drafting).
      attn_impl: a :class:`~specjax.kernel_options.KernelOptions` (static: its
        ``attention`` and the kernels' backends), or just the attention implementation's
        name, ``"auto"``, ``"reference"``, ``"kernel"`` or ``"fused"`` (the last also runs
        the Llama family's projections and head through the row-tiled kernel,
        :func:`uses_fused_layers`).
      features: [T, d] the target's features at the previous positions (feature drafts
        only, ``config.feature_input``).
      return_features: also return the final-normed hidden states [T, d] (static).
      feature_layers: with ``return_features``, return the outputs of these blocks [T, F*d]
        instead (static; what a multi-layer feature draft reads).
      scratch_offset: int32 [] (may be traced): write the new tokens after this many scratch
        slots instead of after M; ``scratch_mask`` is then wider than the slots in use (its
        columns from the offset on must be False). One loop body can so draft levels that
        each see more slots than the level before (:mod:`specjax.methods.speculative`).
    Returns:
      (logits float32 [T, V], cache with the new K/V in its scratch slots or ``None``),
      with the hidden states [T, d] between them when ``return_features``.
    """
    taps_wanted = tuple(feature_layers) if return_features else ()
    if (uses_fused_layers(config, tokens.shape[0], attn_impl) and HEAD_SUBSET not in params
            and not config.draft_vocab_size):
        x, cache, taps = _residual_stream(params, config, tokens, positions, cache, mask,
                                          scratch_mask, attn_impl, features, taps_wanted,
                                          scratch_offset)
        # Final norm and head in one kernel call, row-tiled like the layers.
        tied = config.tie_word_embeddings
        head = params["embed"] if tied else params["lm_head"]
        options = KernelOptions.of(attn_impl)
        family = _FAMILIES[config.architecture]
        h, norm = family.fused_final_input(params, config, x, options.interpret_variant)
        logits = kernels.fused_linear(h, (head,), norm=norm, transposed=tied,
                                      eps=config.norm_eps, float32_out=True, fallback=True,
                                      interpret_variant=options.interpret_variant,
                                      gpu_linear=options.gpu_linear)
        if config.head_bias:  # Phi's, added to the float32 products as _head adds it
            logits = logits + params["lm_head_bias"].astype(jnp.float32)
        # Elementwise after the kernel (divisor, scale, soft-cap): the same per row.
        logits = finish_logits(config, logits)
        if taps_wanted:
            return logits, taps, cache
        if return_features:
            return logits, _FAMILIES[config.architecture].final_norm(params, config, x), cache
        return logits, cache
    if uses_fused_layers(config, tokens.shape[0], attn_impl):  # fused layers, a jnp head
        # a draft's head only: its numbers decide no token
        kernels.fallbacks.record("fused layers", "a reduced head (a draft's head subset or "
                                 "draft_vocab_size) has no kernel; the jnp head ran",
                                 row_independent=True)
    out = hidden_states(params, config, tokens, positions, cache, mask, scratch_mask,
                        attn_impl=attn_impl, features=features, feature_layers=taps_wanted,
                        scratch_offset=scratch_offset)
    hidden, cache = out[0], out[-1]
    if return_features:
        return lm_head(params, config, hidden), out[1] if taps_wanted else hidden, cache
    return lm_head(params, config, hidden), cache
