"""Logit processing and coupled (Gumbel-max) sampling.

Sampling settings are *traced* values (:class:`SamplingParams`): a new temperature, top-k,
top-p or seed never recompiles. Which *rule* applies (greedy, sampled, sampled with top-k/top-p)
is chosen either on the device, by ``lax.cond`` (one program for every setting: the default
on a CPU and a TPU), or when the program is traced (:attr:`SamplingParams.rule`: one program
per rule and no conditional: the default on a GPU, where XLA runs a conditional by copying
its predicate to the host and waiting for the device; see :func:`static_rules`).

The processed target distribution ``p~`` is defined once, here, and used by every method
and every acceptance rule (residuals included):

1. ``temperature == 0``: ``p~`` is the point mass on ``argmax(logits)`` (greedy).
2. otherwise ``logits / temperature``; then top-k (``top_k > 0`` keeps the ``top_k``
   largest, ties at the boundary kept); then top-p on the renormalised result (keeps the
   smallest prefix of the sorted distribution whose mass reaches ``top_p``, at least one
   token, ties at the boundary kept); then ``log_softmax``.

Coupled sampling: the token at absolute sequence position ``t`` is
``argmax(log p~_t + g_t)`` where ``g_t`` is standard Gumbel noise that depends only on
``(seed, t)``. This is an exact sample from ``p~_t`` (Gumbel-max trick). Because the noise
does not depend on how the token was reached, speculative decoding that gives every tree
node at position ``t`` the same ``g_t`` reproduces autoregressive sampling token for token.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import struct

from specjax.errors import InvalidArgumentError

NEG_INF = -jnp.inf


# The sampling rules a program can be specialised to (SamplingParams.rule).
GREEDY, SAMPLE, TRUNCATE = "greedy", "sample", "truncate"
RULES = (GREEDY, SAMPLE, TRUNCATE)
_RULES_SETTINGS = ("auto", "static", "traced")


@struct.dataclass
class SamplingParams:
    """Sampling settings: traced scalars, and the static rule they select.

    ``rule`` is part of the program, not traced: ``None`` compiles every rule, picked on the
    device from the settings (``lax.cond`` on ``temperature > 0``, and on whether top-k or
    top-p is set); ``"greedy"`` (temperature 0), ``"sample"`` (no top-k, no top-p) or
    ``"truncate"`` compiles that rule alone. A rule must match the settings: made by
    :func:`make_sampling_params` with ``static_rule=True``, it does.
    """

    temperature: jax.Array  # float32 [], 0 means greedy
    top_k: jax.Array  # int32 [], 0 means no top-k
    top_p: jax.Array  # float32 [], in (0, 1]
    seed: jax.Array  # uint32 []
    rule: str | None = struct.field(pytree_node=False, default=None)


def rule_of(temperature: float, top_k: int, top_p: float) -> str:
    """The sampling rule that settings (host values) select."""
    if temperature == 0:
        return GREEDY
    return TRUNCATE if top_k > 0 or top_p < 1.0 else SAMPLE


def static_rules(platform: str, setting: str = "auto") -> bool:
    """Whether programs for ``platform`` get one sampling rule each (no conditional).

    ``setting`` (``KernelOptions.sampling_rules``): ``auto`` (the default) is static on a
    GPU only: there XLA
    runs a ``lax.cond`` by copying its predicate to the host and blocking until the device
    is idle (a fused ``tree`` step held 18 sampling conditionals and ran 5 of them at
    temperature 0, all 18 above),
    while a CPU runs it inline and a TPU on the device. Static rules cost one compile per
    rule used (at most three per program); within a rule, new settings still never
    recompile. ``static`` / ``traced`` force either way.

    Raises:
      InvalidArgumentError: ``setting`` is another value.
    """
    if setting not in _RULES_SETTINGS:
        raise InvalidArgumentError(f"sampling_rules must be one of "
                                   f"{', '.join(_RULES_SETTINGS)}, got {setting!r}")
    if setting == "auto":
        return platform in ("gpu", "cuda", "rocm")
    return setting == "static"


def by_temperature(params: SamplingParams, sampled, greedy, operand):
    """``sampled(operand)`` at temperature > 0, else ``greedy(operand)``: a ``lax.cond``, or
    the one branch ``params.rule`` selects."""
    if params.rule is None:
        return jax.lax.cond(params.temperature > 0, sampled, greedy, operand)
    if params.rule not in RULES:
        raise InvalidArgumentError(f"SamplingParams.rule must be None or one of "
                                   f"{', '.join(RULES)}, got {params.rule!r}")
    return greedy(operand) if params.rule == GREEDY else sampled(operand)


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax`` over the last axis (lowest index on ties), as int32.

    XLA's CPU backend lowers ``argmax`` to a variadic (value, index) reduction that does
    not vectorise: over a 49,152-token vocabulary it takes ~4x as long as a ``max`` followed
    by a minimum over the indices that reach it, which is what a CPU program does. A GPU or
    TPU program keeps ``argmax``: one variadic reduction (two launches in the H100
    program, split in two stages) instead of two (four). Both give the lowest index of the
    maximum; a row holding a NaN gives an index that depends on the platform (the last
    index on the CPU), and callers flag non-finite logits separately. The choice is made
    when the program is lowered for its platform (``lax.platform_dependent``), like
    :func:`top_k`'s.
    """
    return jax.lax.platform_dependent(x, cpu=_first_argmax_by_max, default=_first_argmax_variadic)


def _first_argmax_variadic(x: jax.Array) -> jax.Array:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def _first_argmax_by_max(x: jax.Array) -> jax.Array:
    size = x.shape[-1]
    best = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.min(jnp.where(x == best, jnp.arange(size, dtype=jnp.int32), size), axis=-1)
    return jnp.minimum(index, size - 1)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over the last axis (same values, same indices, lower index first
    on ties) without sorting the whole axis.

    XLA's CPU backend lowers ``lax.top_k`` to a full sort of the axis: on a 49,152-token
    vocabulary that costs ~25 ms for six rows, more than a draft pass. Drafters need only
    a few children per node, so for small static ``k`` a CPU program takes ``k`` passes
    of max-then-first-index instead (``-inf`` entries included, as ``lax.top_k`` would).
    A GPU program keeps ``lax.top_k``: one top-k kernel in the H100 program, where the
    passes are ~5 launches each; a TPU program too (which is faster there is not measured).
    The choice is made when the program is lowered for its platform
    (``lax.platform_dependent``), so a program compiled ahead of time for a GPU on a CPU
    host gets the GPU's.
    """
    if k > 16:
        return jax.lax.top_k(x, k)
    return jax.lax.platform_dependent(x, cpu=lambda x: _top_k_by_passes(x, k),
                                      default=lambda x: tuple(jax.lax.top_k(x, k)))


def _top_k_by_passes(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """:func:`top_k` as ``k`` passes of max-then-first-index (the CPU's)."""
    taken = jnp.zeros(x.shape, jnp.bool_)
    iota = jnp.arange(x.shape[-1], dtype=jnp.int32)
    values, indices = [], []
    for _ in range(k):
        best = jnp.max(jnp.where(taken, NEG_INF, x), axis=-1, keepdims=True)
        index = jnp.min(jnp.where((x == best) & ~taken, iota, x.shape[-1] - 1), axis=-1)
        taken = taken | (iota == index[..., None])
        values.append(best[..., 0])
        indices.append(index)
    return jnp.stack(values, axis=-1).astype(x.dtype), jnp.stack(indices, axis=-1)


def make_sampling_params(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                         seed: int = 0, *, static_rule: bool = False) -> SamplingParams:
    """Validates settings on the host and returns them as device scalars; with
    ``static_rule``, with the rule they select fixed (:class:`SamplingParams`).

    Raises:
      InvalidArgumentError: temperature < 0 or not finite, top_k < 0, top_p outside (0, 1].
    """
    temperature, top_p = float(temperature), float(top_p)
    if not (temperature >= 0.0 and temperature != float("inf")):
        raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {temperature}")
    if int(top_k) != top_k or top_k < 0:
        raise InvalidArgumentError(f"top_k must be an integer >= 0, got {top_k}")
    if not (0.0 < top_p <= 1.0):
        raise InvalidArgumentError(f"top_p must be in (0, 1], got {top_p}")
    if int(seed) != seed or not (0 <= seed < 2**32):
        raise InvalidArgumentError(f"seed must be an integer in [0, 2**32), got {seed}")
    rule = rule_of(temperature, int(top_k), top_p) if static_rule else None
    return SamplingParams(temperature=jnp.float32(temperature), top_k=jnp.int32(top_k),
                          top_p=jnp.float32(top_p), seed=jnp.uint32(seed), rule=rule)


_SIGN_BIT = 0x80000000
_KEY_BITS = 32


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of float32 ``x`` (``-0`` and ``+0`` get one key, ``-inf``
    the smallest of any number): the float's bits with the sign bit set for a positive
    number, all bits flipped for a negative one."""
    x = jnp.where(x == 0, jnp.zeros_like(x), x)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = jnp.uint32(_SIGN_BIT)
    return jnp.where(bits >= sign, ~bits, bits | sign)


def _last_true(holds, shape, unroll: bool) -> jax.Array:
    """The largest uint32 key ``t`` in ``[0, 2**32 - 1)`` where ``holds(t)`` [*shape] is
    true, for a ``holds`` true at 0 and monotone (true up to a point per row, then false):
    32 steps of bisection, each one pass over the row."""
    def step(_, bounds):
        lo, hi = bounds  # holds(lo) and not holds(hi)
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo = jnp.zeros(shape, jnp.uint32)
    hi = jnp.full(shape, jnp.uint32(0xFFFFFFFF))
    return jax.lax.fori_loop(0, _KEY_BITS, step, (lo, hi), unroll=unroll)[0]


def _truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
              branch: bool) -> jax.Array:
    """Applies top-k then top-p to temperature-scaled logits [N, V] (masked -> -inf).

    Neither sorts the vocabulary (a sort of 49,152 logits costs ~11 ms a row on the 2-core
    CPU, ~200 ms for a 16-node tree). Each threshold is found by bisection over
    order-preserving integer keys of the logits (:func:`_order_keys`), 32 passes of one
    comparison and one sum per row, which gives the exact threshold:

    - top-k keeps ``key >= t_k``, ``t_k`` the largest key that at least ``top_k`` logits
      reach, i.e. the ``top_k``-th largest logit (ties at the boundary kept);
    - top-p renormalises over what top-k kept and keeps a token when the mass of the
      tokens *strictly* more likely than it is below ``top_p``: the smallest prefix of the
      sorted distribution whose mass reaches ``top_p``, with ties kept. The most likely
      token always stays.

    ``branch``: skip the search of a setting that is off (``top_k == 0``, ``top_p == 1``)
    with a ``lax.cond`` and run the searches as loops; otherwise (programs without
    conditionals, see :func:`static_rules`) run both searches, unrolled.
    """
    vocab = scaled.shape[-1]
    keys = _order_keys(scaled)
    rows = scaled.shape[:-1] + (1,)
    k = jnp.minimum(top_k, vocab)

    def kth_key(_):
        return _last_true(lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) >= k, rows,
                          unroll=not branch)

    def no_key(_):
        return jnp.zeros(rows, jnp.uint32)

    if branch:
        floor = jax.lax.cond((top_k > 0) & (top_k < vocab), kth_key, no_key, None)
    else:
        floor = jnp.where(top_k > 0, kth_key(None), no_key(None))
    probs = jax.nn.softmax(jnp.where(keys >= floor, scaled, NEG_INF), axis=-1)

    def nucleus_key(_):
        # the keys at or above which the mass strictly above stays below top_p: the
        # last key where the mass above reaches top_p, plus one
        above = _last_true(
            lambda t: jnp.sum(jnp.where(keys > t, probs, 0.0), axis=-1, keepdims=True) >= top_p,
            rows, unroll=not branch)
        return above + 1

    if branch:
        nucleus = jax.lax.cond(top_p < 1.0, nucleus_key, no_key, None)
    else:
        nucleus = jnp.where(top_p < 1.0, nucleus_key(None), no_key(None))
    return jnp.where(keys >= jnp.maximum(floor, nucleus), scaled, NEG_INF)


def _scaled(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """``logits / temperature`` with top-k and top-p applied (masked -> -inf), for T > 0;
    the truncation runs only when one is set."""
    scaled = logits / jnp.maximum(params.temperature, 1e-6)
    if params.rule is not None:
        return _truncate(scaled, params.top_k, params.top_p, branch=False) \
            if params.rule == TRUNCATE else scaled
    truncates = (params.top_k > 0) | (params.top_p < 1.0)
    return jax.lax.cond(truncates,
                        lambda s: _truncate(s, params.top_k, params.top_p, branch=True),
                        lambda s: s, scaled)


def target_log_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """log p~ [N, V] from float32 logits [N, V] (see the module docstring).

    Masked tokens get ``-inf``. At temperature 0 the result is the log of a one-hot
    distribution on the argmax (first index on ties).
    """
    logits = logits.astype(jnp.float32)

    def sampled(x):
        return jax.nn.log_softmax(_scaled(x, params), axis=-1)

    def greedy(x):
        hot = first_argmax(x)[..., None] == jnp.arange(x.shape[-1], dtype=jnp.int32)
        return jnp.where(hot, 0.0, NEG_INF)

    return by_temperature(params, sampled, greedy, logits)


def gumbel_noise(seed: jax.Array, positions: jax.Array, vocab_size: int) -> jax.Array:
    """Standard Gumbel noise [N, V] that depends only on (seed, absolute position)."""
    base = jax.random.PRNGKey(seed)
    keys = jax.vmap(lambda p: jax.random.fold_in(base, p))(positions.astype(jnp.uint32))
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab_size,), jnp.float32))(keys)


def perturbed_scores(log_probs: jax.Array, params: SamplingParams,
                     positions: jax.Array) -> jax.Array:
    """``log p~ + g_position`` [N, V]; at temperature 0 just ``log p~`` (no noise drawn)."""
    vocab = log_probs.shape[-1]
    return by_temperature(params, lambda lp: lp + gumbel_noise(params.seed, positions, vocab),
                          lambda lp: lp, log_probs)


def sample_tokens(logits: jax.Array, params: SamplingParams, positions: jax.Array) -> jax.Array:
    """Coupled sample: int32 [N] tokens for logits [N, V] at absolute positions [N].

    ``argmax(log p~ + g_position)``, computed without normalising: ``log_softmax`` only
    shifts a row by a constant, so the argmax of the (truncated) scaled logits plus the
    noise is the same token. Autoregressive decoding and every coupled verification call
    this one function, so they agree on every node whose logits agree.
    """
    logits = logits.astype(jnp.float32)

    def sampled(x):
        return first_argmax(_scaled(x, params) + gumbel_noise(params.seed, positions,
                                                               x.shape[-1]))

    return by_temperature(params, sampled, first_argmax, logits)
