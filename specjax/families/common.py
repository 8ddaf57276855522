"""What every family module uses: the :class:`Family` record the registry holds, and the
helpers that read and write the Hugging Face config keys the families share."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.rope_scaling import rope_scaling_to_hf


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family, as :mod:`specjax.families` registers it.

    Attributes:
      name: the family's name (its module's).
      model_types: the Hugging Face ``model_type`` values :attr:`from_hf` reads.
      configs: the ``config.family or config.architecture`` values of the configs it
        writes back (:attr:`to_hf`).
      from_hf: ``(model_type, hf_config) -> ModelConfig``, or the Hugging Face config of
        the model it wraps (a multimodal checkpoint's text tower), read in turn.
      to_hf: ``ModelConfig -> hf_config`` (what :attr:`from_hf` reads).
    """

    name: str
    model_types: tuple[str, ...]
    configs: tuple[str, ...]
    from_hf: Callable[[str, Mapping[str, Any]], "ModelConfig | Mapping[str, Any]"]
    to_hf: Callable[[ModelConfig], dict[str, Any]]


def get(cfg: Mapping[str, Any], *names, default=None):
    """The value of the first of ``names`` that ``cfg`` sets (not ``None``), else
    ``default``."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def eos_to_hf(ids: tuple[int, ...]):
    """``eos_token_ids`` as a Hugging Face config writes ``eos_token_id``: a list of several,
    one id alone, or ``None``."""
    if len(ids) > 1:
        return list(ids)
    return ids[0] if ids else None


def eos_tuple(value) -> tuple[int, ...]:
    """A Hugging Face ``eos_token_id`` (one id, a list or ``None``) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


# Activations by their Hugging Face names: the tanh forms of GELU are one function.
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")
# GPT-NeoX's (and StarCoder2's, GPTBigCode's) two-matrix MLP activations.
NEOX_ACTS = {"gelu": "gelu", **{name: "gelu_tanh" for name in GELU_TANH + ("gelu_fast",)}}


def hf_keys(config: ModelConfig, model_type: str, architecture: str, **family) -> dict:
    """The keys of a Hugging Face config that the RoPE families write alike (sizes, RoPE
    base and scaling, tied head, special ids), then ``family``'s own."""
    out: dict[str, Any] = {
        "model_type": model_type, "architectures": [architecture],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": eos_to_hf(config.eos_token_ids), "bos_token_id": config.bos_token_id,
        **family,
    }
    if config.rope_scaling is not None:
        out["rope_scaling"] = rope_scaling_to_hf(config.rope_scaling)
    return out


def refuse_partial_rope(model_type: str, cfg: Mapping[str, Any]) -> None:
    """Raises :class:`InvalidArgumentError` if ``cfg`` asks for RoPE on part of each head
    (``partial_rotary_factor``), which ``model_type``'s transformers class does not do."""
    rope = dict(cfg.get("rope_parameters") or {})
    if float(get(cfg, "partial_rotary_factor", default=rope.get("partial_rotary_factor", 1.0))
             ) != 1.0:
        raise InvalidArgumentError(f"{model_type} with RoPE on part of each head "
                                   f"(partial_rotary_factor) is not supported")


def sliding_layers(model_type: str, cfg: Mapping[str, Any], num_layers: int
                   ) -> list[bool] | None:
    """Which layers slide, by the config's ``layer_types``; ``None`` when it has none."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != num_layers:
        raise InvalidArgumentError(
            f"{model_type} layer_types must be {num_layers} of sliding_attention / "
            f"full_attention, got {types!r}")
    return [t == "sliding_attention" for t in types]


def every_nth_global(cfg: Mapping[str, Any], num_layers: int, default: int) -> list[bool]:
    """Which layers slide when every ``sliding_window_pattern``-th one (``default``) is
    global (Gemma 3, Command R7B)."""
    pattern = int(get(cfg, "sliding_window_pattern", "_sliding_window_pattern",
                      default=default))
    return [(i + 1) % pattern != 0 for i in range(num_layers)]


def windows_of(window: int, sliding) -> tuple:
    """Per-layer windows (0 = global): ``window`` where ``sliding`` says; ``()`` if none
    slides."""
    windows = tuple(window if s else 0 for s in sliding)
    return windows if any(windows) else ()
