"""The jitted steps of draft training (:func:`make_steps`: plain, feature and EAGLE-3
drafts) and the optimizer with its learning-rate schedule."""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.flax_modules import LinenCausalLM
from specjax.models import cast_floats
from specjax.training import feature_draft as fd
from specjax.training.config import TrainConfig
from specjax.training.eagle3 import make_eagle3_steps


def make_steps(target_config, draft_config, cfg: TrainConfig, optimizer):
    """Jitted (train_step, eval_step) closures."""
    import jax
    import jax.numpy as jnp
    import optax

    if cfg.feature_draft:
        return make_feature_train_steps(target_config, draft_config, cfg, optimizer)
    if cfg.eagle3:
        return make_eagle3_steps(target_config, draft_config, cfg.loss_config(), optimizer,
                                 cfg.compute_dtype)

    def batched(params, config, windows):
        """Logits [B, T, V] of windows [B, T] through the Flax module a user's own
        pipeline trains (:mod:`specjax.flax_modules`): the same forward, the same tree."""
        return LinenCausalLM(config, attn_impl="reference").apply({"params": params},
                                                                  windows)[0]

    def loss_fn(trainable, frozen, target_params, windows):
        inputs, labels = windows[:, :-1], windows[:, 1:]
        q_logits = batched(cast_floats({**trainable, **frozen}, cfg.compute_dtype),
                           draft_config, inputs)
        log_q = jax.nn.log_softmax(q_logits, axis=-1)
        terms = {}
        if cfg.loss in ("ce", "ce+kl"):
            terms["ce"] = -jnp.mean(jnp.take_along_axis(log_q, labels[..., None], -1))
        if cfg.loss != "ce":
            p_logits = jax.lax.stop_gradient(batched(target_params, target_config, inputs))
            log_p = jax.nn.log_softmax(p_logits, axis=-1)
            p = jnp.exp(log_p)
            if cfg.loss == "tvd":
                terms["tvd"] = 0.5 * jnp.mean(jnp.sum(jnp.abs(p - jnp.exp(log_q)), axis=-1))
            elif cfg.loss == "lk":  # -log of the acceptance rate at temperature 1
                accept = jnp.sum(jnp.minimum(p, jnp.exp(log_q)), axis=-1)
                terms["lk"] = -jnp.mean(jnp.log(jnp.maximum(accept, 1e-6)))
            else:
                terms["kl"] = jnp.mean(jnp.sum(p * (log_p - log_q), axis=-1))
            agree = jnp.mean(jnp.argmax(p_logits, -1) == jnp.argmax(q_logits, -1))
        else:
            agree = jnp.mean(jnp.argmax(q_logits, -1) == labels)
        total = sum(terms.values())
        return total, {**terms, "agreement": agree}

    @jax.jit
    def train_step(trainable, opt_state, frozen, target_params, windows):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, target_params, windows)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        return trainable, opt_state, loss, aux

    @jax.jit
    def eval_step(trainable, frozen, target_params, windows):
        """(top-1 agreement, KL(p || q)) on held-out windows."""
        inputs = windows[:, :-1]
        q = batched(cast_floats({**trainable, **frozen}, cfg.compute_dtype), draft_config,
                    inputs)
        p = batched(target_params, target_config, inputs)
        log_p, log_q = jax.nn.log_softmax(p, -1), jax.nn.log_softmax(q, -1)
        kl = jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))
        return jnp.mean(jnp.argmax(p, -1) == jnp.argmax(q, -1)), kl

    return train_step, eval_step


def make_feature_train_steps(target_config, draft_config, cfg: TrainConfig, optimizer):
    """:func:`make_steps` for a feature draft: the same signatures, the target's features
    from the frozen target pass, :func:`~specjax.training.feature_draft.
    feature_loss` over the full head; evaluation reports depth-1 agreement and KL."""
    import jax
    import jax.numpy as jnp

    loss_cfg = fd.FeatureLossConfig(noise=cfg.feature_noise, unroll=cfg.feature_unroll,
                                    feature_weight=cfg.feature_weight)
    plain = dataclasses.replace(loss_cfg, noise=0.0, unroll=1)
    base_key = jax.random.PRNGKey(cfg.seed)

    def inputs(frozen, target_params, windows):
        windows = windows[:, :-1]
        features = jax.lax.stop_gradient(
            fd.target_features(target_params, target_config, windows))
        return windows, features, fd.head_rows(frozen, draft_config, None)

    def loss_fn(trainable, frozen, target_params, windows):
        # Noise drawn per batch (the key follows the batch's tokens: reruns repeat it).
        key = jax.random.fold_in(base_key, jnp.sum(windows))
        windows, features, rows = inputs(frozen, target_params, windows)
        return fd.feature_loss(cast_floats({**trainable, **frozen}, cfg.compute_dtype),
                               draft_config, windows, features, rows, loss_cfg, key)

    train_step = fd.jitted_train_step(loss_fn, optimizer)

    @jax.jit
    def eval_step(trainable, frozen, target_params, windows):
        """(depth-1 top-1 agreement, KL(p || q)) on held-out windows."""
        windows, features, rows = inputs(frozen, target_params, windows)
        metrics = fd.feature_loss(cast_floats({**trainable, **frozen}, cfg.compute_dtype),
                                  draft_config, windows, features, rows, plain, base_key)[1]
        return metrics["agreement"], metrics["kl"]

    return train_step, eval_step


def learning_rate(cfg: TrainConfig, step: int, clock: float = 0.0) -> float:
    """The learning rate of step ``step`` (0-based) of an EAGLE-3 run: linear warm-up over
    ``warmup_steps``, then a cosine from ``learning_rate`` down to a tenth of it over the
    run's progress, the larger of its steps' and ``clock`` (the fraction of a time budget
    spent; 0 without one). The steps' progress runs from ``schedule_start`` when warm-up
    ends to 1 at the last step (a budgeted run's clock, which ran on while it compiled,
    replayed by step count)."""
    warmup = min(cfg.warmup_steps, cfg.steps - 1)
    if step < warmup:
        return cfg.learning_rate * step / max(warmup, 1)
    start = cfg.schedule_start
    steps_done = (step - warmup) / max(cfg.steps - warmup, 1)
    progress = max(start + (1.0 - start) * steps_done, clock)
    progress = min(max(progress, 0.0), 1.0)
    return cfg.learning_rate * (0.1 + 0.45 * (1.0 + np.cos(np.pi * progress)))


def set_learning_rate(opt_state, value: float):
    """``opt_state`` of :func:`make_optimizer` for an EAGLE-3 run, its learning rate set
    to ``value`` (an input of the jitted step, so a new value does not recompile)."""
    import jax.numpy as jnp

    opt_state[1].hyperparams["learning_rate"] = jnp.asarray(value, jnp.float32)
    return opt_state


def make_optimizer(cfg: TrainConfig):
    import optax

    if cfg.eagle3:  # the rate is set before each step (learning_rate, set_learning_rate)
        adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=cfg.learning_rate,
                                                      weight_decay=cfg.weight_decay)
        return optax.chain(optax.clip_by_global_norm(1.0), adamw)
    warmup = min(cfg.warmup_steps, cfg.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, warmup, max(cfg.steps, warmup + 1),
        end_value=cfg.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=cfg.weight_decay))
