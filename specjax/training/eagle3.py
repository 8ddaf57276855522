"""EAGLE-3-class feature drafts (Li et al., "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test", 2025): a one-block draft that reads the
outputs of several target blocks, with a head of its own over a reduced vocabulary.

The draft is a Llama-family model whose config has ``feature_input``, ``feature_layers``
(the target blocks it reads, default :func:`default_feature_layers`: SpecForge's rule
``(1, L/2 - 1, L - 4)``, ``(1, 14, 26)`` for a 30-block SmolLM2) and ``draft_vocab_size``
(see :mod:`specjax.models.decoder` for its parameters). At position ``t`` it reads:

* the embedding of token ``x_t`` (the target's own table, shared and frozen: never stored
  in the draft's asset);
* a feature ``g_t``: at the root and in the draft's cache, the target's block outputs at
  ``t - 1`` concatenated ([F*d]) and fused by ``feature_fc`` [F*d, d]; at a drafted
  position below the root, the draft's own output (after its final norm) at ``t - 1``.

Its input is ``[embed(x_t); rms_norm(g_t)] @ fc`` (the ``fc`` [2d, d] route of
:mod:`~specjax.training.feature_draft`: the same block and cache machinery as any
draft, where EAGLE-3 feeds the 2d vector to q/k/v itself with ``g`` as residual), then one
decoder block, its final norm, and its head ``draft_head`` [K, d] over K ids of the
vocabulary chosen by frequency in the training text (``draft_vocab`` maps them to target
ids; FR-Spec). SmolLM2 ties its embedding, so the head starts as a copy of those rows of
the target's table, and trains. The draft gives probability 0 to every other id;
verification always uses the target's full head, so exactness is the verify rule's.

Training (:func:`eagle3_loss`): the target's block outputs and logits come from a frozen
target pass inside the jitted step. They are not written to disk (the issue asked for 16-bit
feature shards): three SmolLM2 block outputs are 3 x 576 x 2 = 3.5 KB per token in 16 bits,
so one H100 window's 42 M training tokens would be ~145 GB, over the device's 64 GB disk.
**Training-time test**: ``unroll`` passes over each window; pass 0 reads the target's
features, pass ``i`` reads pass ``i - 1``'s outputs shifted by one position, which is what a
depth-``i + 1`` node reads when decoding. Its attention sees exactly what that node sees:
pass 0's keys up to position ``t - i`` (the draft's cache), then the keys of passes 1 to i
at positions ``t - i + 1`` to ``t`` (the node's drafted ancestors and itself). Loss per
pass: KL from the target's probabilities over the draft's vocabulary (soft labels,
renormalised; the cross-entropy against them less their entropy, so the same gradient;
positions whose target argmax lies outside the vocabulary are left out, as in EAGLE-3), or
instead (``--loss tvd`` / ``--loss lk``) the acceptance rate at temperature 1 itself,
alpha = sum_k min(p_k, q_k) with p over the full vocabulary, as 1 - alpha or -log alpha
(LK-style: the objective decoding pays for, which a small draft's KL optimum need not
maximise); plus optionally ``acceptance_weight`` x (1 - alpha); weighted ``decay ** i``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specjax import models
from specjax.attention import attention_reference
from specjax.errors import InvalidArgumentError
from specjax.models import cast_floats, decoder
from specjax.training.feature_draft import feature_draft_from_target, jitted_train_step


OBJECTIVES = ("kl", "tvd", "lk")
# alpha's floor inside -log alpha (a position where the draft gives the target's tokens no
# mass would otherwise have an infinite loss).
_MIN_ACCEPTANCE = 1e-6


@dataclasses.dataclass(frozen=True)
class Eagle3LossConfig:
    """Loss settings of EAGLE-3 draft training (see the module docstring).

    Attributes:
      unroll: training-time-test passes (depths trained), at least 1.
      decay: the weight of pass ``i`` is ``decay ** i``.
      acceptance_weight: weight of the acceptance objective 1 - sum min(p, q) added to
        the objective.
      objective: what each pass minimises (:data:`OBJECTIVES`): ``kl`` (KL from the
        target's soft labels, EAGLE-3's), ``tvd`` (1 - alpha, alpha = sum_k min(p_k, q_k)
        the acceptance rate at temperature 1: the total variation distance) or ``lk``
        (-log alpha, LK-style: the acceptance rate itself, a position's gradient scaled
        by 1 / alpha where the draft is far off).
    """

    unroll: int = 4
    decay: float = 0.8
    acceptance_weight: float = 0.0
    objective: str = "kl"

    def __post_init__(self):
        if not isinstance(self.unroll, int) or self.unroll < 1:
            raise InvalidArgumentError(f"unroll must be an integer >= 1, got {self.unroll!r}")
        if not 0 < self.decay <= 1:
            raise InvalidArgumentError(f"decay must be in (0, 1], got {self.decay}")
        if not self.acceptance_weight >= 0:
            raise InvalidArgumentError(
                f"acceptance_weight must be >= 0, got {self.acceptance_weight}")
        if self.objective not in OBJECTIVES:
            raise InvalidArgumentError(f"unknown EAGLE-3 objective {self.objective!r}; "
                                       f"expected one of {OBJECTIVES}")


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """SpecForge's choice of target blocks (low, middle, high): ``(1, L/2 - 1, L - 4)``,
    clipped to the model and without repeats (a tiny model gets fewer)."""
    picks = (1, num_layers // 2 - 1, num_layers - 4)
    out: list[int] = []
    for layer in picks:
        layer = min(max(layer, 0), num_layers - 1)
        if layer not in out:
            out.append(layer)
    return tuple(out)


def eagle3_draft_from_target(target_config, target_params: dict, draft_vocab,
                             feature_layers: Sequence[int] | None = None,
                             init_layers: Sequence[int] = (0,)):
    """(config, params) of an untrained EAGLE-3 draft (numpy arrays).

    Args:
      target_config, target_params: the target (Llama family).
      draft_vocab: the ids [K] its head scores (e.g.
        :func:`~specjax.checkpoints_tools.sources.frequent_tokens` of the training text).
      feature_layers: target blocks it reads (default :func:`default_feature_layers`).
      init_layers: target blocks its own blocks start from.
    Returns:
      The draft's blocks are copies of the target's ``init_layers``, its final norm the
      target's, ``fc = [I; 0]`` (it starts reading the token alone), ``feature_fc`` picks
      the last feature layer, and ``draft_head`` is a copy of the target head's rows of
      ``draft_vocab``; ``embed`` is the target's (shared, frozen).
    """
    vocab = np.asarray(draft_vocab, np.int64)
    size = target_config.vocab_size
    if (vocab.ndim != 1 or vocab.size == 0 or vocab.min() < 0 or vocab.max() >= size
            or np.unique(vocab).size != vocab.size):
        raise InvalidArgumentError(f"draft_vocab must be distinct ids in [0, {size})")
    layers = (default_feature_layers(target_config.num_layers) if feature_layers is None
              else tuple(int(i) for i in feature_layers))
    if not layers or any(not 0 <= i < target_config.num_layers for i in layers):
        raise InvalidArgumentError(f"feature_layers {layers} out of range for a "
                                   f"{target_config.num_layers}-layer target")
    config, params = feature_draft_from_target(target_config, target_params, init_layers)
    config = dataclasses.replace(config, feature_layers=layers, draft_vocab_size=int(vocab.size))
    d = target_config.hidden_size
    dtype = np.asarray(params["fc"]).dtype
    table = (np.asarray(target_params["embed"]) if target_config.tie_word_embeddings
             else np.asarray(target_params["lm_head"]).T)
    feature_fc = np.zeros((len(layers) * d, d), dtype)
    feature_fc[-d:] = np.eye(d, dtype=dtype)
    params = {k: v for k, v in params.items() if k not in ("lm_head", "lm_head_bias")}
    params.update(feature_fc=feature_fc, draft_head=np.array(table[vocab], dtype),
                  draft_vocab=vocab.astype(np.int32))
    return config, params


def split_eagle3_trainable(params: dict) -> tuple[dict, dict]:
    """(trainable, frozen): everything trains but the shared embedding and the id map."""
    frozen = {k: v for k, v in params.items() if k in ("embed", "draft_vocab")}
    return {k: v for k, v in params.items() if k not in frozen}, frozen


def shift(x):
    """What position ``t`` reads: ``x[t - 1]``, zeros at ``t = 0`` (along axis -2)."""
    import jax.numpy as jnp

    pad = jnp.zeros_like(x[..., :1, :])
    return jnp.concatenate([pad, x[..., :-1, :]], axis=-2)


def step_mask(num_tokens: int, step: int, source: int):
    """bool [T, T]: which positions ``s`` of pass ``source``'s keys a position ``t`` of pass
    ``step`` sees: pass 0 up to ``t - step`` (the draft's cache, behind the root), pass
    ``j >= 1`` only at ``t - step + j`` (the drafted ancestor at that depth; ``j = step``
    is the position itself). Pass 0 of itself is causal."""
    import jax.numpy as jnp

    t = jnp.arange(num_tokens)[:, None]
    s = jnp.arange(num_tokens)[None, :]
    if source == 0:
        return s <= t - step
    return s == t - step + source


def unroll_draft(params: dict, config, tokens, target_features, unroll: int):
    """The training-time-test passes of an EAGLE-3 draft over one window.

    Args:
      params: the draft's parameters; ``config`` its config.
      tokens: int32 [T] the window.
      target_features: [T, F*d] the target's block outputs at each position.
      unroll: passes.
    Returns:
      (inputs, outputs): per pass the feature each position read [T, d] and the draft's
      output (final-normed hidden state) [T, d]. Pass 0 reads the target's fused feature
      at ``t - 1``, pass ``i`` reads pass ``i - 1``'s output at ``t - 1``.
    """
    import jax
    import jax.numpy as jnp

    num_tokens = tokens.shape[0]
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    rope = decoder.position_context(config, positions)
    masks = [[step_mask(num_tokens, i, j) for j in range(i + 1)] for i in range(unroll)]
    feature = shift(models.fuse_features(params, config, target_features))
    keys: list = []  # per pass: [L, T, K, D] keys and values of every block
    values: list = []
    inputs, outputs = [], []
    windows = decoder.layer_windows(config)
    for i in range(unroll):
        mask = jnp.concatenate(masks[i], axis=1)  # [T, (i + 1) T]
        # Every pass's row s stands for position s: how far back each key is.
        behind = positions[:, None] - jnp.tile(positions, i + 1)[None, :]
        x = decoder.embed(params, config, tokens, positions, feature)
        earlier = (jnp.stack(keys, axis=1) if keys else None,
                   jnp.stack(values, axis=1) if values else None)

        def layer(carry, scanned, mask=mask, behind=behind):
            x = carry
            p, index, k_before, v_before = scanned
            if config.layer_windows:  # the layer's sliding window, as decoding applies it
                window = windows[index]
                mask = mask & ((window == 0) | (behind < window))

            def attend(q, k, v):
                if k_before is not None:  # [i, T, K, D]: passes 0 .. i-1 of this block
                    k = jnp.concatenate([k_before.reshape(-1, *k.shape[1:]), k])
                    v = jnp.concatenate([v_before.reshape(-1, *v.shape[1:]), v])
                return attention_reference(q, k, v, None, None, 0, mask,
                                           scale=config.query_scale,
                                           softcap=config.attn_softcap)

            # the layer's own RoPE tables: local or global (Gemma 3), or none (NoPE)
            x, k, v = decoder.block(p, config, x, decoder.layer_context(config, rope, index),
                                  attend)
            return x, (k, v)

        indices = jnp.arange(config.num_layers, dtype=jnp.int32)
        x, (k, v) = jax.lax.scan(layer, x, (params["layers"], indices, *earlier))
        keys.append(k)
        values.append(v)
        out = decoder.final_norm(params, config, x)
        inputs.append(feature)
        outputs.append(out)
        feature = shift(out)
    return inputs, outputs


def target_pass(target_params: dict, target_config, windows, feature_layers):
    """The frozen target over windows [B, T]: (logits float32 [B, T, V], block outputs
    [B, T, F*d])."""
    import jax
    import jax.numpy as jnp

    positions = jnp.arange(windows.shape[1], dtype=jnp.int32)

    def one(tokens):
        hidden, taps, _ = models.hidden_states(target_params, target_config, tokens,
                                               positions, attn_impl="reference",
                                               feature_layers=tuple(feature_layers))
        return models.lm_head(target_params, target_config, hidden), taps

    logits, taps = jax.vmap(one)(windows)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(taps)


def eagle3_loss(params: dict, config, windows, target_logits, target_features,
                loss_cfg: Eagle3LossConfig):
    """(loss, metrics) of an EAGLE-3 draft on windows [B, T] given the target's logits
    [B, T, V] and block outputs [B, T, F*d] there.

    Metrics per pass ``i`` (depth ``i + 1``), over positions ``t >= i``: ``kl{i+1}``
    (KL(p || q) over the draft's vocabulary, p renormalised there, the loss term),
    ``agreement{i+1}`` (the draft's argmax, mapped to target ids, equals the target's
    argmax over the full vocabulary; a target argmax outside the draft's vocabulary counts
    as a miss), ``acceptance{i+1}`` (sum min(p, q) at temperature 1) and
    ``log_acceptance{i+1}`` (the mean of its log). The loss is each pass's objective
    (``loss_cfg.objective``: the KL, 1 - acceptance, or -log_acceptance) plus
    ``acceptance_weight`` x (1 - acceptance), weighted ``decay ** i``.
    """
    import jax
    import jax.numpy as jnp

    vocab = params["draft_vocab"]
    num_tokens = windows.shape[1]
    logp_full = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    target_best = jnp.argmax(target_logits, axis=-1)  # [B, T]
    in_vocab = jnp.zeros((config.vocab_size,), jnp.bool_).at[vocab].set(True)[target_best]
    sub = jnp.take(target_logits.astype(jnp.float32), vocab, axis=-1)  # [B, T, K]
    log_soft = jax.nn.log_softmax(sub, axis=-1)  # soft labels: p renormalised over the vocab
    soft = jnp.exp(log_soft)
    p_in = jnp.exp(jnp.take(logp_full, vocab, axis=-1))  # p itself over the vocab

    _, outputs = jax.vmap(lambda w, f: unroll_draft(params, config, w, f, loss_cfg.unroll))(
        windows, target_features)
    positions = jnp.arange(num_tokens)
    total, metrics = 0.0, {}
    for i, out in enumerate(outputs):
        logq = jax.nn.log_softmax(
            # as decoding scores them (lm_head: a Granite divisor, a Gemma soft-cap)
            models.finish_logits(config, jax.vmap(
                lambda h: models.draft_logits(params, config, h))(out).astype(jnp.float32)),
            axis=-1)
        valid = jnp.broadcast_to(positions >= i, target_best.shape)
        counted = valid & in_vocab
        # KL(soft || q): the cross-entropy against the soft labels less their entropy.
        kl = jnp.sum(soft * (log_soft - logq), axis=-1)
        loss = jnp.sum(jnp.where(counted, kl, 0.0)) / jnp.maximum(jnp.sum(counted), 1)
        accept = jnp.sum(jnp.minimum(p_in, jnp.exp(logq)), axis=-1)
        acceptance = jnp.sum(jnp.where(valid, accept, 0.0)) / jnp.sum(valid)
        log_acceptance = jnp.sum(jnp.where(
            valid, jnp.log(jnp.maximum(accept, _MIN_ACCEPTANCE)), 0.0)) / jnp.sum(valid)
        proposal = vocab[jnp.argmax(logq, axis=-1)]
        agree = jnp.sum(valid & (proposal == target_best)) / jnp.sum(valid)
        objective = {"kl": loss, "tvd": 1.0 - acceptance,
                     "lk": -log_acceptance}[loss_cfg.objective]
        weight = loss_cfg.decay ** i
        total = total + weight * (objective + loss_cfg.acceptance_weight * (1.0 - acceptance))
        metrics.update({f"kl{i + 1}": loss, f"agreement{i + 1}": agree,
                        f"acceptance{i + 1}": acceptance,
                        f"log_acceptance{i + 1}": log_acceptance})
    return total, metrics


def make_eagle3_steps(target_config, draft_config, loss_cfg: Eagle3LossConfig, optimizer,
                      compute_dtype: str = "float32"):
    """Jitted ``(train_step, eval_step)`` with the signatures of
    :func:`specjax.commands.train_draft.make_steps`: windows [B, T + 1] (the last
    token only ends the window), the target's logits and block outputs computed inside
    the step by a frozen target pass (``target_params`` already in ``compute_dtype``; the
    draft's float32 parameters are cast to it inside the step, so its products run in that
    dtype and its gradients and optimizer state stay float32). ``eval_step`` returns the
    metrics dict (per-depth agreement included) with ``agreement`` and ``kl`` those of
    depth 1."""
    import jax

    layers = draft_config.feature_layers

    def loss_fn(trainable, frozen, target_params, windows):
        windows = windows[:, :-1]
        logits, features = target_pass(target_params, target_config, windows, layers)
        # Float32 master weights; the products in compute_dtype (the target's params come
        # already cast).
        params = cast_floats({**trainable, **frozen}, compute_dtype)
        return eagle3_loss(params, draft_config, windows, logits, features, loss_cfg)

    train_step = jitted_train_step(loss_fn, optimizer)

    @jax.jit
    def eval_step(trainable, frozen, target_params, windows):
        _, metrics = loss_fn(trainable, frozen, target_params, windows)
        metrics = dict(metrics)
        metrics["agreement"] = metrics["agreement1"]
        metrics["kl"] = metrics["kl1"]
        return metrics

    return train_step, eval_step
