"""Model configuration: a small, frozen, hashable dataclass that is static under ``jit``.

One :class:`ModelConfig` describes every architecture specjax runs. ``architecture`` picks
the forward function (``"llama"`` covers Llama 2/3, SmolLM/SmolLM2, Qwen2 and Mistral;
``"gpt2"`` covers GPT-2). Presets are factory functions; :func:`from_hf_config` reads a
Hugging Face ``config.json`` (a dict or a ``transformers`` config object) and
:meth:`ModelConfig.to_hf_config` writes one back, so a model can round-trip through an HF
directory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from specjax.errors import InvalidArgumentError

ARCHITECTURES = ("llama", "gpt2")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is ``"linear"`` or ``"llama3"``."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder-only transformer.

    Attributes:
      architecture: ``"llama"`` (RMSNorm, RoPE, SwiGLU, GQA) or ``"gpt2"`` (LayerNorm,
        learned positions, GELU MLP).
      vocab_size: V, rows of the embedding.
      hidden_size: model width.
      num_layers: transformer blocks.
      num_heads: H, query heads.
      num_kv_heads: K, key/value heads (``num_heads % num_kv_heads == 0``).
      head_dim: D, width of one head.
      intermediate_size: MLP width.
      max_position_embeddings: largest position id + 1 the model supports.
      norm_eps: epsilon of RMSNorm / LayerNorm.
      rope_theta: RoPE base (llama only).
      rope_scaling: optional :class:`RopeScaling` (llama only).
      tie_word_embeddings: the output head is the transposed embedding.
      qkv_bias: q/k/v projections have a bias (Qwen2, GPT-2).
      out_bias: the attention output projection has a bias (GPT-2, Llama with
        ``attention_bias``).
      mlp_bias: MLP projections have biases (GPT-2, Llama with ``mlp_bias``).
      eos_token_ids: token ids that end generation by default.
      bos_token_id: token id prepended by tokenizers that add one (informational).
      sliding_window: attention window (Mistral); generation longer than it is refused.
      feature_input: a feature draft (EAGLE-style, llama family only): its blocks read
        ``[embed(token_t); rms_norm(f_{t-1})] @ fc``, where ``f_{t-1}`` is the target's
        final-normed hidden state at the previous position, and its output (after its own
        final norm) predicts the target's feature at ``t`` (see
        :mod:`specjax.checkpoints_tools.feature_draft`).
      feature_layers: a multi-layer feature draft (EAGLE-3 class; needs ``feature_input``):
        the target blocks (0-based) whose outputs it reads, concatenated [T, F*d] and fused
        to [T, d] by the draft's ``feature_fc`` [F*d, d] before ``fc``; its own output
        (after its final norm) is what its deeper positions read instead (see
        :mod:`specjax.checkpoints_tools.eagle3`). Empty: the target's final-normed hidden
        state, as above.
      draft_vocab_size: a head of the model's own over a reduced vocabulary of this many
        ids (``draft_head`` [K, d] and the int32 map ``draft_vocab`` [K] to the full
        vocabulary's ids); every other id gets logit -inf (probability 0). 0: the usual
        head over the whole vocabulary. For drafts: verification uses the target's full
        head, so exactness never depends on it.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None
    feature_input: bool = False
    feature_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise InvalidArgumentError(
                f"unknown architecture {self.architecture!r}; expected one of {ARCHITECTURES}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.architecture == "llama" and self.head_dim % 2:
            raise InvalidArgumentError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.feature_input and self.architecture != "llama":
            raise InvalidArgumentError(
                f"feature_input drafts are llama-family models, got {self.architecture!r}")
        if self.feature_layers:
            if not self.feature_input:
                raise InvalidArgumentError("feature_layers apply to feature drafts only "
                                           "(feature_input=True)")
            layers = self.feature_layers
            if (not isinstance(layers, tuple) or any(not isinstance(i, int) or i < 0
                                                     for i in layers)
                    or len(set(layers)) != len(layers)):
                raise InvalidArgumentError(f"feature_layers must be a tuple of distinct "
                                           f"target block indices >= 0, got {layers!r}")
        if (not isinstance(self.draft_vocab_size, int)
                or not 0 <= self.draft_vocab_size <= self.vocab_size):
            raise InvalidArgumentError(f"draft_vocab_size must be an int in [0, "
                                       f"{self.vocab_size}], got {self.draft_vocab_size!r}")

    @property
    def num_params(self) -> int:
        """Number of parameters (embedding counted once when the head is tied)."""
        from specjax.models import param_shapes  # local import: models depend on config

        return sum(math.prod(shape) for shape in _flatten(param_shapes(self)))

    def to_hf_config(self) -> dict[str, Any]:
        """Returns a Hugging Face ``config.json`` dict describing the same model."""
        if self.feature_input or self.draft_vocab_size:
            raise InvalidArgumentError(
                "a feature draft or a reduced-vocabulary head has no Hugging Face equivalent")
        if self.architecture == "gpt2":
            return {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": self.vocab_size,
                "n_embd": self.hidden_size,
                "n_layer": self.num_layers,
                "n_head": self.num_heads,
                "n_inner": self.intermediate_size,
                "n_positions": self.max_position_embeddings,
                "layer_norm_epsilon": self.norm_eps,
                "activation_function": "gelu_new",
                "tie_word_embeddings": True,
                "eos_token_id": self.eos_token_ids[0] if self.eos_token_ids else None,
                "bos_token_id": self.bos_token_id,
            }
        if self.qkv_bias and not self.out_bias:
            model_type, arch = "qwen2", "Qwen2ForCausalLM"
        else:
            model_type, arch = "llama", "LlamaForCausalLM"
        out: dict[str, Any] = {
            "model_type": model_type,
            "architectures": [arch],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else
            (self.eos_token_ids[0] if self.eos_token_ids else None),
            "bos_token_id": self.bos_token_id,
        }
        if model_type == "llama":
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = self.mlp_bias
        if self.rope_scaling is not None:
            scaling = {"rope_type": self.rope_scaling.kind, "factor": self.rope_scaling.factor}
            if self.rope_scaling.kind == "llama3":
                scaling.update(
                    low_freq_factor=self.rope_scaling.low_freq_factor,
                    high_freq_factor=self.rope_scaling.high_freq_factor,
                    original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings,
                )
            out["rope_scaling"] = scaling
        return out


def _flatten(tree):
    if isinstance(tree, Mapping):
        for value in tree.values():
            yield from _flatten(value)
    else:
        yield tree


# ----------------------------------------------------------------------------- presets


def gpt2(size: str = "124m") -> ModelConfig:
    """GPT-2 presets: ``124m`` (gpt2), ``355m`` (medium), ``774m`` (large), ``1.5b`` (xl)."""
    shapes = {"124m": (768, 12, 12), "355m": (1024, 24, 16), "774m": (1280, 36, 20),
              "1.5b": (1600, 48, 25)}
    if size not in shapes:
        raise InvalidArgumentError(f"unknown GPT-2 size {size!r}; expected one of {list(shapes)}")
    width, layers, heads = shapes[size]
    return ModelConfig(
        architecture="gpt2", vocab_size=50257, hidden_size=width, num_layers=layers,
        num_heads=heads, num_kv_heads=heads, head_dim=width // heads,
        intermediate_size=4 * width, max_position_embeddings=1024, norm_eps=1e-5,
        tie_word_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True,
        eos_token_ids=(50256,), bos_token_id=50256,
    )


def smollm2_135m() -> ModelConfig:
    """SmolLM2-135M(-Instruct): Llama architecture, 30 layers, GQA 9/3, tied head."""
    return ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, intermediate_size=1536, max_position_embeddings=8192,
        norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        eos_token_ids=(2,), bos_token_id=1,
    )


PRESETS = {
    "gpt2": lambda: gpt2("124m"),
    "gpt2-medium": lambda: gpt2("355m"),
    "gpt2-large": lambda: gpt2("774m"),
    "gpt2-xl": lambda: gpt2("1.5b"),
    "smollm2-135m": smollm2_135m,
}


# ----------------------------------------------------------------------------- from HF

_LLAMA_FAMILY = ("llama", "mistral", "qwen2", "smollm", "smollm2", "smollm3")


def _get(cfg: Mapping[str, Any], *names, default=None):
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _eos_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 folds theta and scaling into ``rope_parameters``; older configs use
    # ``rope_theta`` + ``rope_scaling``.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(_get(cfg, "rope_theta", default=params.get("rope_theta", 10000.0)))
    merged = {**params, **scaling}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(merged["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3", float(merged["factor"]), float(merged.get("low_freq_factor", 1.0)),
            float(merged.get("high_freq_factor", 4.0)),
            int(merged.get("original_max_position_embeddings", 8192)),
        )
    raise InvalidArgumentError(
        f"unsupported rope scaling type {kind!r}; specjax supports default, linear and llama3"
    )


def from_hf_config(cfg: Mapping[str, Any] | Any) -> ModelConfig:
    """Builds a :class:`ModelConfig` from a Hugging Face config (dict or config object).

    Raises:
      InvalidArgumentError: the model type is not supported.
    """
    if not isinstance(cfg, Mapping):
        cfg = cfg.to_dict()
    model_type = cfg.get("model_type")
    if model_type == "gpt2":
        width = int(cfg["n_embd"])
        heads = int(cfg["n_head"])
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise InvalidArgumentError(f"unsupported GPT-2 activation {act!r}; expected gelu_new")
        return ModelConfig(
            architecture="gpt2", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
            num_layers=int(cfg["n_layer"]), num_heads=heads, num_kv_heads=heads,
            head_dim=width // heads, intermediate_size=int(cfg.get("n_inner") or 4 * width),
            max_position_embeddings=int(cfg.get("n_positions", 1024)),
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), tie_word_embeddings=True,
            qkv_bias=True, out_bias=True, mlp_bias=True,
            eos_token_ids=_eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        )
    if model_type in _LLAMA_FAMILY:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise InvalidArgumentError(f"unsupported {model_type} activation {act!r}; expected silu")
        heads = int(cfg["num_attention_heads"])
        width = int(cfg["hidden_size"])
        theta, scaling = _rope_from_hf(cfg)
        if model_type == "qwen2":
            qkv_bias, out_bias, mlp_bias = True, False, False
        else:
            qkv_bias = out_bias = bool(cfg.get("attention_bias", False))
            mlp_bias = bool(cfg.get("mlp_bias", False))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return ModelConfig(
            architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
            num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
            head_dim=int(_get(cfg, "head_dim", default=width // heads)),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            norm_eps=float(_get(cfg, "rms_norm_eps", default=1e-6)), rope_theta=theta,
            rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=mlp_bias,
            eos_token_ids=_eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
            sliding_window=int(window) if window else None,
        )
    raise InvalidArgumentError(
        f"unsupported model_type {model_type!r}; specjax supports gpt2 and {', '.join(_LLAMA_FAMILY)}"
    )
