"""Feature drafts (EAGLE-style; Li et al., "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty", 2024): a small draft that reads the target's features.

A feature draft is a Llama-family model whose config has ``feature_input`` (see
:mod:`specjax.methods.speculative` for how ``spec``/``tree`` run it). At position ``t`` its
blocks read ``[embed(x_t); rms_norm(f_{t-1})] @ fc``, where ``f_{t-1}`` is the target's
final-normed hidden state at ``t - 1`` (normed again with the draft's own
``feature_norm``, which starts at the embedding's RMS, so that both halves start on one
scale); its output, after its own final norm, predicts the target's
feature ``f_t``, and the target's head (shared, tied or not) turns the prediction into
next-token logits. A target pass computes ``f`` for every token it verifies, so the draft
knows what the target "was thinking" up to the last committed token; below the root it
reads its own predictions.

Training (teacher forcing over token windows; the target's features are computed by a
frozen target pass, or read from a cache of them):

* inputs: ``(x_t, f_{t-1} + noise)`` for ``t >= 1`` (EAGLE's uniform feature noise, so
  the draft tolerates its own imperfect predictions below the root);
* loss: ``smooth_l1(f^_t, f_t)`` (per feature, averaged) plus ``kl_weight`` x
  ``KL(p_t || q_t)``, where ``p_t`` / ``q_t`` are the target's head applied to ``f_t`` /
  ``f^_t`` over the draft's head tokens (the subset it decodes with; renormalised);
* ``unroll=2`` adds the same loss for a second pass whose inputs are the draft's own
  first-pass predictions (what a depth-2 node reads), EAGLE-3's "training-time test" in
  its simplest form.

The draft starts from target blocks ``init_layers`` with ``fc = [I; 0]``: before training
it is the target's first block(s) reading the token embedding alone. Or it starts from a
trained standalone draft (:func:`feature_draft_from_draft`), again with ``fc = [I; 0]``:
it then computes exactly that draft, and training adds what the features carry.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specjax import models
from specjax.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class FeatureLossConfig:
    """Loss settings of feature-draft training (see the module docstring)."""

    kl_weight: float = 1.0
    feature_weight: float = 1.0
    noise: float = 0.1
    unroll: int = 1

    def __post_init__(self):
        if self.unroll not in (1, 2):
            raise InvalidArgumentError(f"unroll must be 1 or 2, got {self.unroll!r}")
        if self.noise < 0 or self.kl_weight < 0 or self.feature_weight < 0:
            raise InvalidArgumentError("noise, kl_weight and feature_weight must be >= 0")


def feature_draft_from_target(target_config, target_params: dict,
                              init_layers: Sequence[int] = (0,)):
    """(config, params) of an untrained feature draft: the target's blocks ``init_layers``,
    its embedding, final norm and head, and ``fc = [I; 0]`` (numpy arrays)."""
    import jax

    if target_config.architecture != "llama":
        raise InvalidArgumentError(
            f"feature drafts are built from Llama-family targets, not "
            f"{target_config.architecture}")
    num = target_config.num_layers
    if not init_layers or any(not 0 <= i < num for i in init_layers):
        raise InvalidArgumentError(f"init_layers {tuple(init_layers)} out of range for a "
                                   f"{num}-layer target")
    index = np.asarray(init_layers)
    layers = jax.tree.map(lambda a: np.array(np.asarray(a)[index]), target_params["layers"])
    params = {**{k: np.asarray(v) for k, v in target_params.items() if k != "layers"},
              "layers": layers, **_feature_input(target_params["embed"])}
    config = dataclasses.replace(target_config, num_layers=len(index), feature_input=True)
    return config, params


def _feature_input(embed) -> dict:
    """``fc = [I; 0]`` (the blocks read the token embedding alone) and a ``feature_norm``
    at the embedding's RMS."""
    embed = np.asarray(embed)
    d, dtype = embed.shape[1], embed.dtype
    rms = np.sqrt(np.mean(np.square(embed.astype(np.float64))))
    return {"fc": np.concatenate([np.eye(d, dtype=dtype), np.zeros((d, d), dtype)]),
            "feature_norm": np.full((d,), rms, dtype)}


def feature_draft_from_draft(config, params: dict):
    """(config, params) of a feature draft that computes exactly the standalone Llama-family
    draft ``(config, params)``: the same blocks, norm and head, and ``fc = [I; 0]``."""
    if config.feature_input:
        return config, params
    if config.architecture != "llama":
        raise InvalidArgumentError(
            f"feature drafts are Llama-family models, not {config.architecture}")
    return (dataclasses.replace(config, feature_input=True),
            {**params, **_feature_input(params["embed"])})


def head_rows(params: dict, config, head_tokens):
    """The target head's rows [K, d] of ``head_tokens`` (the whole head when ``None``)."""
    import jax.numpy as jnp

    table = params["embed"] if config.tie_word_embeddings else params["lm_head"].T
    return table if head_tokens is None else jnp.take(table, jnp.asarray(head_tokens), axis=0)


def head_scores(params: dict, config, rows, hidden):
    """float32 logits [..., K] of ``hidden`` [..., d] over the head rows ``rows`` [K, d] as
    decoding computes them: the head's bias (Phi; only over the whole vocabulary), then the
    family's logit transform (:func:`specjax.models.finish_logits`).

    Raises:
      InvalidArgumentError: a head with a bias scored over a subset of its rows.
    """
    import jax.numpy as jnp

    logits = hidden.astype(jnp.float32) @ rows.T.astype(jnp.float32)
    bias = params.get("lm_head_bias") if config.head_bias else None
    if bias is not None:
        if rows.shape[0] != config.vocab_size:
            raise InvalidArgumentError("a head with a bias (Phi) is scored over its whole "
                                       "vocabulary, not a subset of its rows")
        logits = logits + bias.astype(jnp.float32)
    return models.finish_logits(config, logits)


def _batched_hidden(params: dict, config, windows, inputs=None):
    """Final-normed hidden states [B, T, d] of windows [B, T] (plain causal forwards),
    reading ``inputs`` [B, T, d] when the model is a feature draft."""
    import jax
    import jax.numpy as jnp

    positions = jnp.arange(windows.shape[1], dtype=jnp.int32)

    def one(tokens, feats):
        return models.hidden_states(params, config, tokens, positions, attn_impl="reference",
                                    features=feats)[0]

    return jax.vmap(one)(windows, inputs)


def target_features(target_params: dict, target_config, windows):
    """The target's features [B, T, d] (final-normed hidden states) of windows [B, T]."""
    return _batched_hidden(target_params, target_config, windows)


def draft_features(params: dict, config, windows, inputs):
    """The draft's predicted features [B, T, d] for windows [B, T] reading ``inputs``
    [B, T, d] (the feature each position reads: the target's at ``t - 1``)."""
    return _batched_hidden(params, config, windows, inputs)


def shift_features(features):
    """What position ``t`` reads: ``features[t - 1]``, zeros at ``t = 0`` ([B, T, d])."""
    import jax.numpy as jnp

    return jnp.concatenate([jnp.zeros_like(features[:, :1]), features[:, :-1]], axis=1)


def feature_loss(params: dict, config, windows, features, rows, loss_cfg: FeatureLossConfig,
                 key):
    """(loss, metrics) of a feature draft on windows [B, T] with the target's features
    [B, T, d]; ``rows`` [K, d] the head rows scored (:func:`head_rows`), as decoding scores
    them (Phi's head bias, Granite's divisor, Cohere's scale, Gemma 2's soft-cap). Positions
    ``t >= 1`` count; metrics: ``feature`` (smooth L1), ``kl``, ``agreement`` (the draft's
    argmax over ``rows`` equals the target's) and, with ``unroll=2``, ``agreement2``.

    Raises:
      InvalidArgumentError: a head with a bias (Phi) scored over a subset of its rows.
    """
    import jax
    import jax.numpy as jnp
    import optax

    def scores(hidden):
        return head_scores(params, config, rows, hidden)

    features = features.astype(jnp.float32)
    target_logp = jax.nn.log_softmax(scores(features), axis=-1)
    target_best = jnp.argmax(target_logp, axis=-1)

    def terms(predicted):
        predicted = predicted.astype(jnp.float32)[:, 1:]
        logq = jax.nn.log_softmax(scores(predicted), axis=-1)
        logp = target_logp[:, 1:]
        kl = jnp.mean(jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1))
        feat = jnp.mean(optax.huber_loss(predicted, features[:, 1:], delta=1.0))
        agree = jnp.mean(jnp.argmax(logq, axis=-1) == target_best[:, 1:])
        return loss_cfg.feature_weight * feat + loss_cfg.kl_weight * kl, feat, kl, agree

    inputs = shift_features(features)
    noise = jax.random.uniform(key, inputs.shape, jnp.float32, -loss_cfg.noise, loss_cfg.noise)
    first = draft_features(params, config, windows, inputs + noise)
    loss, feat, kl, agree = terms(first)
    metrics = {"feature": feat, "kl": kl, "agreement": agree}
    if loss_cfg.unroll == 2:
        # What a depth-2 node reads: the draft's own prediction for its parent.
        second = draft_features(params, config, windows, shift_features(first))
        loss2, _, _, agree2 = terms(second)
        loss = loss + loss2
        metrics["agreement2"] = agree2
    return loss, metrics


def make_feature_steps(config, loss_cfg: FeatureLossConfig, optimizer):
    """Jitted ``(train_step, eval_step)``.

    ``train_step(trainable, opt_state, frozen, windows, features, rows, key)`` returns
    ``(trainable, opt_state, loss, metrics)``; ``eval_step(params, windows, features,
    rows)`` returns the metrics without noise (and with the second unroll). ``frozen``
    holds the shared embedding and head (:func:`split_feature_trainable`)."""
    import jax
    import optax

    def loss_fn(trainable, frozen, windows, features, rows, key):
        return feature_loss({**trainable, **frozen}, config, windows, features, rows,
                            loss_cfg, key)

    @jax.jit
    def train_step(trainable, opt_state, frozen, windows, features, rows, key):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, windows, features, rows, key)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, metrics

    plain = dataclasses.replace(loss_cfg, noise=0.0, unroll=2)

    @jax.jit
    def eval_step(params, windows, features, rows):
        return feature_loss(params, config, windows, features, rows, plain,
                            jax.random.PRNGKey(0))[1]

    return train_step, eval_step


def split_feature_trainable(params: dict) -> tuple[dict, dict]:
    """(trainable, frozen): the draft's blocks, ``fc`` and final norm train; the shared
    embedding and head stay the target's."""
    frozen = {k: v for k, v in params.items() if k in ("embed", "lm_head", "lm_head_bias")}
    return {k: v for k, v in params.items() if k not in frozen}, frozen


def jitted_train_step(loss_fn, optimizer):
    """``train_step(trainable, opt_state, frozen, target_params, windows)``, jitted: one
    ``optimizer`` update along the gradient of ``loss_fn`` (same arguments less
    ``opt_state``, returning ``(loss, aux)``) with respect to ``trainable``; returns the
    new ``(trainable, opt_state, loss, aux)``. The feature and EAGLE-3 drafts' step."""
    import jax
    import optax

    @jax.jit
    def train_step(trainable, opt_state, frozen, target_params, windows):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, target_params, windows)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, aux

    return train_step
