"""A loaded model: static config, device parameters, tokenizer.

:class:`Model` sits below the API and the checkpoint tools: loaders build it, methods and
:func:`specjax.generate` read it. It holds no state between calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import models
from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.models import check_params

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16, "float16": jnp.float16, "fp16": jnp.float16}


def resolve_dtype(dtype):
    """Accepts None, a jnp dtype, or a name such as ``"bf16"``."""
    if dtype is None or not isinstance(dtype, str):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


@dataclasses.dataclass(eq=False)
class Model:
    """A loaded model: static config, device parameters, tokenizer (or ``None``)."""

    config: ModelConfig
    params: dict
    tokenizer: Any = None
    name: str = "model"
    # The known model (``specjax/assets/<assets>``) whose shipped draft and n-gram tables
    # apply, when this model was loaded from one (or converted from one); else None.
    assets: str | None = None

    @classmethod
    def from_params(cls, config: ModelConfig, params: dict, tokenizer: Any = None,
                    name: str = "model", dtype=None, assets: str | None = None) -> "Model":
        """Wraps a parameter tree (numpy or jax arrays) after a strict shape check.
        ``dtype`` casts the floating-point arrays (integer ones, e.g. a reduced head's
        ``draft_vocab`` map, keep theirs)."""
        check_params(config, params, source=name)
        dtype = resolve_dtype(dtype)
        params = jax.tree.map(lambda a: jnp.asarray(a, dtype if dtype is not None and
                                                    jnp.issubdtype(jnp.asarray(a).dtype,
                                                                   jnp.floating) else None),
                              params)
        return cls(config=config, params=params, tokenizer=tokenizer, name=name,
                   assets=assets)

    @property
    def dtype(self):
        """The dtype of the parameters (of the embedding)."""
        return self.params["embed"].dtype

    def with_head_subset(self, tokens) -> "Model":
        """This model with its output head restricted to ``tokens`` (ids), for use as a
        draft: a pass reads K output rows instead of V. Tokens outside the subset get the
        row's lowest subset logit (see :func:`specjax.models.head_subset_params`). The
        target must keep its full head; speculative methods stay exact either way."""
        base = {k: v for k, v in self.params.items() if k != models.HEAD_SUBSET}
        params = models.head_subset_params(base, self.config, tokens)
        return dataclasses.replace(self, params=params)

    def with_fused_projections(self) -> "Model":
        """This model with each layer's q|k|v and gate|up matrices fused into one each
        (:func:`specjax.models.fuse_projections`): ``attn_impl="fused"`` then runs each in
        one kernel (on a GPU a Llama-family layer is 5 launches, 7 with separate q, k, v).
        The weights are concatenated once, into new arrays (drop this model to free the
        old ones); this model itself if they are fused already. A draft resolved for a
        fused target (the shipped one, an asset folder or a path) is fused too; fuse a
        draft you pass as a Model yourself."""
        if models.projections_fused(self.params):
            return self
        return dataclasses.replace(self, params=models.fuse_projections(self.config,
                                                                        self.params))

    @property
    def head_size(self) -> int:
        """Tokens the output head scores (the vocabulary, or the subset's size)."""
        subset = self.params.get(models.HEAD_SUBSET)
        return self.config.vocab_size if subset is None else int(subset["tokens"].shape[0])

    def first_layers(self, num_layers: int) -> "Model":
        """A smaller model made of this one's first ``num_layers`` blocks, embedding, final
        norm and head (an untrained starting point for a draft; it shares the tokenizer)."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise InvalidArgumentError(
                f"num_layers must be in [1, {self.config.num_layers}], got {num_layers}")
        params = dict(self.params, layers=jax.tree.map(lambda a: a[:num_layers],
                                                       self.params["layers"]))
        config = dataclasses.replace(self.config, num_layers=num_layers)
        return Model(config, params, self.tokenizer, f"{self.name}[:{num_layers} layers]")


def check_draft_compatible(model: Model, draft: Model) -> None:
    """Raises :class:`InvalidArgumentError` if ``draft`` cannot draft for ``model``."""
    if draft.config.vocab_size != model.config.vocab_size:
        raise InvalidArgumentError(
            f"draft {draft.name!r} has vocabulary size {draft.config.vocab_size}, the target "
            f"{model.name!r} has {model.config.vocab_size}: they must share one tokenizer")
    if draft.config.feature_input and draft.config.hidden_size != model.config.hidden_size:
        raise InvalidArgumentError(
            f"feature draft {draft.name!r} reads features of width {draft.config.hidden_size}, "
            f"the target {model.name!r} has hidden size {model.config.hidden_size}")
    layers = draft.config.feature_layers
    if layers and max(layers) >= model.config.num_layers:
        raise InvalidArgumentError(
            f"feature draft {draft.name!r} reads the outputs of target blocks {layers}, the "
            f"target {model.name!r} has {model.config.num_layers}")
    if (model.tokenizer is not None and draft.tokenizer is not None
            and model.tokenizer is not draft.tokenizer):  # a shipped draft shares the target's
        if model.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise InvalidArgumentError(
                f"draft {draft.name!r} and target {model.name!r} use different tokenizers")


