"""A loaded model: static config, device parameters, tokenizer.

:class:`Model` sits below the API and the checkpoint tools: loaders build it, methods and
:func:`specjax.generate` read it. It holds no state between calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import jinja2

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
    """A loaded model: static config, device parameters, tokenizer (or ``None``).

    ``progress``: whether :func:`specjax.generate` and :func:`specjax.stream_generate`
    report each compilation on stderr when their own ``progress=`` is not given.
    ``specjax.load(..., progress=True)`` sets it; :meth:`with_progress` changes it.
    """

    config: ModelConfig
    params: dict
    tokenizer: Any = None
    name: str = "model"
    # The known model (``specjax/assets/<assets>``) whose shipped draft and n-gram tables
    # apply, when this model was loaded from one (or converted from one); else None.
    assets: str | None = None
    progress: bool = False

    @classmethod
    def from_params(cls, config: ModelConfig, params: dict, tokenizer: Any = None,
                    name: str = "model", dtype=None, assets: str | None = None) -> "Model":
        """Wraps a parameter tree (numpy or jax arrays) after a strict shape check.
        ``dtype`` casts the floating-point arrays (integer ones, e.g. a reduced head's
        ``draft_vocab`` map, keep theirs)."""
        check_params(config, params, source=name)
        dtype = resolve_dtype(dtype)
        if dtype is not None:
            params = models.cast_floats(params, dtype)
        params = jax.tree.map(jnp.asarray, params)
        return cls(config=config, params=params, tokenizer=tokenizer, name=name,
                   assets=assets)

    def with_progress(self, enabled: bool = True) -> "Model":
        """This model (the same parameters, not copied) with ``progress`` set: the default
        of ``progress=`` in :func:`specjax.generate` and :func:`specjax.stream_generate`.

        Args:
          enabled: report compilations on stderr (each call may still say otherwise).
        Returns:
          A :class:`Model` sharing this one's parameters and tokenizer.
        """
        return dataclasses.replace(self, progress=bool(enabled))

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
        (:func:`specjax.models.fuse_projections`): attention ``"fused"`` then runs each in
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
    """Raises :class:`InvalidArgumentError` if ``draft`` cannot draft for ``model``.

    Vocabulary sizes may differ by padding rows only (models of one family in different
    sizes, e.g. Qwen2.5-0.5B's 151,936 rows and Qwen2.5-7B's 152,064 over one tokenizer):
    both tokenizers must be known, equal, and hold no id past the smaller size;
    :func:`pad_draft_vocabulary` then gives the draft the target's rows.
    """
    if draft.config.vocab_size != model.config.vocab_size:
        sizes = (f"draft {draft.name!r} has vocabulary size {draft.config.vocab_size}, the "
                 f"target {model.name!r} has {model.config.vocab_size}")
        if model.tokenizer is None or draft.tokenizer is None:
            raise InvalidArgumentError(
                f"{sizes}: without both tokenizers the extra rows cannot be told to be "
                f"padding; they must share one tokenizer")
        _check_same_tokenizer(model, draft)
        used = len(model.tokenizer)
        if used > min(draft.config.vocab_size, model.config.vocab_size):
            raise InvalidArgumentError(
                f"{sizes}, but their tokenizer has {used} tokens: the rows differ by more "
                f"than padding")
    if draft.config.feature_input and draft.config.hidden_size != model.config.hidden_size:
        raise InvalidArgumentError(
            f"feature draft {draft.name!r} reads features of width {draft.config.hidden_size}, "
            f"the target {model.name!r} has hidden size {model.config.hidden_size}")
    layers = draft.config.feature_layers
    if layers and max(layers) >= model.config.num_layers:
        raise InvalidArgumentError(
            f"feature draft {draft.name!r} reads the outputs of target blocks {layers}, the "
            f"target {model.name!r} has {model.config.num_layers}")
    if model.tokenizer is not None and draft.tokenizer is not None:
        _check_same_tokenizer(model, draft)


def _check_same_tokenizer(model: Model, draft: Model) -> None:
    """Raises naming the first difference between the two tokenizers' vocabularies."""
    if model.tokenizer is draft.tokenizer:  # a shipped draft shares the target's
        return
    ours, theirs = model.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if ours == theirs:
        return
    prefix = f"draft {draft.name!r} and target {model.name!r} use different tokenizers"
    moved = sorted((i, t) for t, i in theirs.items() if t in ours and ours[t] != i)
    if moved:
        token = moved[0][1]
        raise InvalidArgumentError(f"{prefix}: token {token!r} is id {theirs[token]} in the "
                                   f"draft, {ours[token]} in the target")
    only = sorted(set(theirs) ^ set(ours), key=lambda t: theirs.get(t, ours.get(t)))
    where = "draft" if only[0] in theirs else "target"
    raise InvalidArgumentError(f"{prefix}: {len(only)} tokens are in one only (the first, "
                               f"{only[0]!r}, in the {where})")


def pad_draft_vocabulary(draft: Model, vocab_size: int) -> Model:
    """``draft`` with ``vocab_size`` embedding and head rows: padding rows (zeros) added,
    or padding rows past ``vocab_size`` dropped (:func:`check_draft_compatible` checked
    that no token uses them). A padding row's logit is 0; whatever the draft proposes, the
    target's verification keeps the output exact."""
    have = draft.config.vocab_size
    if have == vocab_size:
        return draft

    def rows(table, axis):
        if have > vocab_size:
            return jax.lax.slice_in_dim(table, 0, vocab_size, axis=axis)
        pad = [(0, 0)] * table.ndim
        pad[axis] = (0, vocab_size - have)
        return jnp.pad(table, pad)

    params = dict(draft.params, embed=rows(draft.params["embed"], 0))
    if "lm_head" in params:
        params["lm_head"] = rows(params["lm_head"], 1)
    if "lm_head_bias" in params:
        params["lm_head_bias"] = rows(params["lm_head_bias"], 0)
    config = dataclasses.replace(draft.config, vocab_size=vocab_size)
    return dataclasses.replace(draft, config=config, params=params,
                               name=f"{draft.name}[vocabulary {have} -> {vocab_size}]")


def encode_prompt(model: Model, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
    """Token ids for a prompt string (optionally through the chat template) or id list."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError("prompt is empty")
        if model.tokenizer is None:
            raise InvalidArgumentError(
                f"model {model.name!r} has no tokenizer: pass a list of token ids")
        if chat:
            if not getattr(model.tokenizer, "chat_template", None):
                raise InvalidArgumentError(f"model {model.name!r} has no chat template")
            try:
                ids = model.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True,
                    tokenize=True)
            except jinja2.TemplateError as error:  # a sandbox refusal or a broken template
                message = " ".join(str(error).split())
                raise InvalidArgumentError(f"model {model.name!r}: its chat template "
                                           f"failed ({message})") from None
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            # verbose=False: a prompt longer than the model's context gets specjax's own
            # one-line error (from plan_capacity), not a transformers warning beside it.
            ids = model.tokenizer(prompt, verbose=False)["input_ids"]
        ids = list(ids)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidArgumentError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
    if bad:
        raise InvalidArgumentError(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {model.config.vocab_size})")
    return ids
