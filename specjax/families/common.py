"""What every family module uses: the :class:`Family` record the registry holds, and the
helpers that read and write the Hugging Face config keys the families share."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.rope_scaling import rope_scaling_to_hf


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """How llama.cpp writes a family's models: one ``general.architecture`` of GGUF files.

    Attributes:
      name: the architecture's name (the ``{arch}.`` of its metadata keys).
      tensor_names: GGUF tensor name -> Hugging Face name (``{i}``: the block), so that the
        family's key rules read the file as they read its HF checkpoints.
      config: ``metadata -> ModelConfig``, where ``metadata`` is the loader's view of the
        file (:class:`specjax.checkpoints_tools.gguf_loader.GGUFMetadata`: ``arch``,
        ``source``, ``names``, ``meta``, ``field``, ``special_token_ids``,
        ``rope_factors``).
      permuted: llama.cpp's converter permuted the rows of Q and K for its RoPE (undone on
        load).
      transform: ``(GGUF name, array, config) -> array`` for tensors stored otherwise than
        the HF checkpoint holds them; ``None``: every tensor as stored.
    """

    name: str
    tensor_names: Mapping[str, str]
    config: Callable[[Any], ModelConfig]
    permuted: bool = False
    transform: Callable[[str, np.ndarray, ModelConfig], np.ndarray] | None = None


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
      key_rules: ``ModelConfig -> [Rule]``, its checkpoints' tensor names and how each
        fills the parameters (:mod:`specjax.families.rules`).
      checkpoint_name: ``(stored name, config) -> the name its key rules give`` where a
        checkpoint may store a tensor under another name; ``None``: every name as stored.
      ignores: ``(name, config) -> bool``, the tensors of its checkpoints that hold no
        parameter (buffers, another model's tower); ``None``: none of its own.
      export_prefix: put before every tensor name when a model is written back.
      gguf: the GGUF architectures (llama.cpp's names) its models are written as.
      gguf_tensors: ``(GGUF name, array, config) -> {HF name: array}`` for the GGUF tensors
        that are not one HF tensor each (stacked experts), else ``None``; ``None``: every
        tensor by its architecture's name table.
      native_despite_auto_map: model types whose published checkpoints still name their own
        code (``auto_map``, written before transformers had the class) for an architecture
        transformers and specjax implement: their ``auto_map`` is ignored (no code is run
        either way).
    """

    name: str
    model_types: tuple[str, ...]
    configs: tuple[str, ...]
    from_hf: Callable[[str, Mapping[str, Any]], "ModelConfig | Mapping[str, Any]"]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    key_rules: Callable[[ModelConfig], list]
    checkpoint_name: Callable[[str, ModelConfig], str] | None = None
    ignores: Callable[[str, ModelConfig], bool] | None = None
    export_prefix: str = ""
    gguf: tuple[GGUFArchitecture, ...] = ()
    gguf_tensors: Callable[[str, np.ndarray, ModelConfig], dict | None] | None = None
    native_despite_auto_map: tuple[str, ...] = ()


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


# ----------------------------------------------------------------------------- GGUF


def float32_value(value) -> float:
    """A GGUF float as the value the model was converted with: GGUF stores floats as float32
    (1e-5 comes back as 9.99999974e-06), and the shortest decimal that round-trips through
    float32 recovers it."""
    return float(str(np.float32(value)))


def config_from_gguf_keys(gguf, from_hf: Callable, cfg: Mapping[str, Any]) -> ModelConfig:
    """``from_hf`` (a family's) of ``cfg``, the Hugging Face config keys a GGUF file's
    metadata gives; an invalid model is a :class:`CheckpointError` naming the file."""
    try:
        return from_hf(cfg["model_type"], cfg)
    except InvalidArgumentError as error:
        raise CheckpointError(f"{gguf.source}: GGUF metadata describes an invalid model "
                              f"({error})") from None


def layer_norm_gguf_config(gguf, family: dict, from_hf: Callable) -> ModelConfig:
    """The config of a file of the LayerNorm families (RoPE partial or whole, never scaled)
    (``gptneox``, ``phi2``, ``starcoder2``, ``starcoder``, ``command-r``, ``cohere2``): the
    keys they share, then ``family``'s, as the Hugging Face config ``from_hf`` reads."""
    arch, meta, source = gguf.arch, gguf.meta, gguf.source
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    if heads == 0 or hidden % heads:
        raise CheckpointError(f"{source}: GGUF metadata '{arch}.attention.head_count' "
                              f"({heads}) does not divide the width ({hidden})")
    if (meta("rope.scaling.type", "none", kind=str) != "none"
            or "rope_freqs.weight" in gguf.names):
        raise CheckpointError(f"{source}: RoPE scaling in a {arch} file is not supported")
    tokens = gguf.field("tokenizer.ggml.tokens", kind=list)
    eos, bos = gguf.special_token_ids()
    head_dim = hidden // heads
    cfg = {
        "vocab_size": len(tokens) if tokens is not None else meta("vocab_size"),
        "hidden_size": hidden, "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads, "intermediate_size": meta("feed_forward_length"),
        "max_position_embeddings": meta("context_length"),
        "layer_norm_eps": float32_value(meta("attention.layer_norm_epsilon", kind=float)),
        "rope_theta": float32_value(meta("rope.freq_base", 10000.0, kind=float)),
        "partial_rotary_factor": meta("rope.dimension_count", head_dim) / head_dim,
        "tie_word_embeddings": "output.weight" not in gguf.names,
        "eos_token_id": eos or None, "bos_token_id": bos, **family,
    }
    return config_from_gguf_keys(gguf, from_hf, cfg)
