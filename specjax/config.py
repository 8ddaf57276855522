"""Model configuration: a small, frozen, hashable dataclass that is static under ``jit``.

One :class:`ModelConfig` describes every architecture specjax runs. ``architecture`` picks
the forward function (``"llama"`` covers Llama 2/3, SmolLM/SmolLM2, Qwen2, Mistral, and with
the optional fields below Qwen3, Gemma 2, Gemma 3 (text) and Phi-3; ``"gpt2"`` covers
GPT-2); :class:`RopeScaling` covers the long-context RoPE variants (linear, Llama 3, YaRN,
LongRoPE). Presets are factory functions; :func:`from_hf_config` reads a
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
HIDDEN_ACTS = ("silu", "gelu_tanh", "gelu")
NORM_KINDS = ("rms", "layer", "layer_nobias")


ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Hugging Face's ``rope_type`` (``kind``) and its parameters.

    * ``"linear"``: every inverse frequency divided by ``factor``.
    * ``"llama3"``: long wavelengths divided by ``factor``, short ones kept, the band
      between ``low_freq_factor`` and ``high_freq_factor`` interpolated.
    * ``"yarn"``: YaRN (Qwen2.5/Qwen3 long context, DeepSeek): frequencies interpolated by
      ``factor`` below a ramp between ``beta_slow`` and ``beta_fast`` rotations over
      ``original_max_position_embeddings``, extrapolated above it, and cos/sin scaled by
      ``attention_factor``.
    * ``"longrope"``: LongRoPE (Phi-3.5, Phi-4-mini; also llama.cpp's per-frequency
      ``rope_freqs`` factors): frequency ``i`` divided by ``short_factor[i]``, or by
      ``long_factor[i]`` when ``long``, and cos/sin scaled by ``attention_factor``.
      Transformers picks the long factors for a forward pass whose positions reach past
      ``original_max_position_embeddings``; specjax picks them once per generation, for
      every position of it, when the prompt plus ``max_new_tokens`` does
      (:meth:`ModelConfig.for_length`), as llama.cpp does by its context size, so that
      every method and every pass of a generation rotates a position alike.

    ``attention_factor`` is stored resolved (Hugging Face derives a default from
    ``factor``, ``mscale`` and ``mscale_all_dim``; :func:`from_hf_config` does so).
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    long: bool = False

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise InvalidArgumentError(f"unknown rope scaling kind {self.kind!r}; expected one "
                                       f"of {ROPE_SCALINGS}")
        for name in ("short_factor", "long_factor"):  # JSON gives lists; keep it hashable
            value = getattr(self, name)
            try:
                factors = tuple(float(f) for f in value)
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"rope scaling {name} must be a list of numbers, got {value!r}") from None
            if any(not f > 0 for f in factors):  # also NaN
                raise InvalidArgumentError(f"rope scaling {name} must be > 0, got {value!r}")
            object.__setattr__(self, name, factors)
        if self.kind == "longrope" and (
                not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise InvalidArgumentError(
                f"longrope needs short_factor and long_factor of one length (head_dim / 2), "
                f"got {len(self.short_factor)} and {len(self.long_factor)}")
        for name in ("factor", "attention_factor"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(
                    f"rope scaling {name} must be > 0, got {getattr(self, name)!r}")
        if (self.kind in ("llama3", "yarn", "longrope")
                and (not isinstance(self.original_max_position_embeddings, int)
                     or self.original_max_position_embeddings < 1)):
            raise InvalidArgumentError(
                f"{self.kind} rope scaling needs original_max_position_embeddings >= 1, got "
                f"{self.original_max_position_embeddings!r}")


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
      rope_scaling: optional :class:`RopeScaling` (llama only): linear, Llama 3, YaRN or
        LongRoPE.
      tie_word_embeddings: the output head is the transposed embedding.
      qkv_bias: q/k/v projections have a bias (Qwen2, GPT-2).
      out_bias: the attention output projection has a bias (GPT-2, Llama with
        ``attention_bias``).
      mlp_bias: MLP projections have biases (GPT-2, Llama with ``mlp_bias``).
      eos_token_ids: token ids that end generation by default.
      bos_token_id: token id prepended by tokenizers that add one (informational).
      sliding_window: attention window (Mistral); generation longer than it is refused.
      family: the Hugging Face ``model_type`` of a family that needs the optional fields
        below (``"qwen3"``, ``"gemma"``, ``"gemma2"``, ``"gemma3_text"``, ``"phi3"``,
        ``"smollm3"``, ``"granite"``, ``"olmo2"``, ``"olmo3"``, ``"stablelm"``,
        ``"gpt_neox"``, ``"phi"``, ``"starcoder2"``, ``"gpt_bigcode"``, ``"cohere"``,
        ``"cohere2"``, ``"mixtral"``, ``"qwen2_moe"``, ``"qwen3_moe"``, ``"olmoe"``), so the
        config writes the same type back; ``None`` for the others.
      qk_norm: per-head RMSNorm of q and k (weights [D]) before RoPE (Qwen3, Gemma 3).
      qk_norm_whole: with ``qk_norm``, q and k are normed over all their heads at once
        (weights [H*D] and [K*D]), not per head (OLMo 2/3).
      norm_plus_one: RMSNorm scales by ``1 + w`` (Gemma), not ``w``.
      hidden_act: the MLP's gate activation, ``"silu"`` (SwiGLU) or ``"gelu_tanh"``
        (GeGLU with the tanh approximation, Gemma); or, without ``gated_mlp``, its one
        activation (``"gelu"``, the exact erf form: GPT-NeoX/Pythia).
      norm_kind: ``"rms"`` (RMSNorm), ``"layer"`` (LayerNorm with a bias: GPT-NeoX; the
        norms' biases are ``attn_norm_bias``, ``mlp_norm_bias``, ``final_norm_bias``) or
        ``"layer_nobias"`` (LayerNorm with a scale only: Cohere).
      gated_mlp: the MLP is ``down(act(gate(x)) * up(x))``; ``False``: ``down(act(up(x)))``
        (GPT-NeoX).
      parallel_residual: attention and MLP both read the block's input and add to it
        together, ``x + attn(norm1(x)) + mlp(norm2(x))`` (GPT-NeoX/Pythia's
        ``use_parallel_residual``); ``False``: one after the other.
      embed_scale: embeddings are multiplied by sqrt(hidden_size), rounded to the model
        dtype first (Gemma).
      sandwich_norms: RMSNorm also on the attention and MLP outputs before each residual
        add (Gemma 2/3: four norms per block).
      pre_norms: RMSNorm on each block's attention and MLP inputs (every family but OLMo
        2/3, which norm only their outputs: ``pre_norms=False`` with ``sandwich_norms``).
      query_scale: attention scores scale (Gemma's ``query_pre_attn_scalar ** -0.5``,
        Granite's ``attention_multiplier``); ``None`` is ``head_dim ** -0.5``.
      attn_softcap: attention scores become ``c * tanh(s / c)`` before the mask (Gemma 2).
      final_softcap: logits become ``c * tanh(logits / c)`` (Gemma 2).
      layer_windows: per-layer sliding windows (a query at position p sees keys at
        positions > p - w; 0 = global attention) as a pattern: layer ``i`` has window
        ``layer_windows[i % len(layer_windows)]``; ``()``: every layer global. Stored as
        its shortest period: Gemma 2 ``(w, 0)``, Gemma 3 ``(w,) * 5 + (0,)``, Phi-3
        ``(w,)``.
      local_rope_theta: RoPE base of the sliding-window layers (Gemma 3); those layers use
        no ``rope_scaling``. ``None``: every layer uses ``rope_theta``.
      rotary_dim: RoPE rotates only the first ``rotary_dim`` dims of each query and key
        head, the rest pass through (partial rotary: Phi-4-mini's
        ``partial_rotary_factor``); ``None``: the whole head.
      no_rope_layers: which layers apply RoPE, as Hugging Face's SmolLM3 writes it (1: RoPE,
        0: none, a "NoPE" layer), a pattern like ``layer_windows`` (layer ``i`` reads entry
        ``i % len``; stored as its shortest period: SmolLM3 ``(1, 1, 1, 0)``); ``()``:
        every layer.
      embed_multiplier: embeddings are multiplied by this (Granite's
        ``embedding_multiplier``); ``None``: by nothing.
      residual_multiplier: each block's attention and MLP outputs are multiplied by this
        before their residual adds (Granite); ``None``: by nothing.
      logits_divisor: logits are divided by this (Granite's ``logits_scaling``); ``None``:
        by nothing.
      logit_scale: logits are multiplied by this (Cohere's ``logit_scale``); ``None``: by
        nothing.
      feature_input: a feature draft (EAGLE-style, llama family only): its blocks read
        ``[embed(token_t); rms_norm(f_{t-1})] @ fc``, where ``f_{t-1}`` is the target's
        final-normed hidden state at the previous position, and its output (after its own
        final norm) predicts the target's feature at ``t`` (see
        :mod:`specjax.training.feature_draft`).
      feature_layers: a multi-layer feature draft (EAGLE-3 class; needs ``feature_input``):
        the target blocks (0-based) whose outputs it reads, concatenated [T, F*d] and fused
        to [T, d] by the draft's ``feature_fc`` [F*d, d] before ``fc``; its own output
        (after its final norm) is what its deeper positions read instead (see
        :mod:`specjax.training.eagle3`). Empty: the target's final-normed hidden
        state, as above.
      draft_vocab_size: a head of the model's own over a reduced vocabulary of this many
        ids (``draft_head`` [K, d] and the int32 map ``draft_vocab`` [K] to the full
        vocabulary's ids); every other id gets logit -inf (probability 0). 0: the usual
        head over the whole vocabulary. For drafts: verification uses the target's full
        head, so exactness never depends on it.
      num_experts: E > 0: every block's MLP is a mixture of E experts (Mixtral, Qwen3-MoE,
        OLMoE), each a gated MLP of width ``intermediate_size`` (``we_gate``, ``we_up``,
        ``we_down``, stacked [L, E, ...]), picked per token by a router (``router``
        [L, d, E]): the ``experts_per_token`` experts of highest softmax probability
        (float32) run, and their outputs are summed weighted by those probabilities.
        0: one dense MLP.
      experts_per_token: k, the experts each token runs (with ``num_experts``).
      normalize_expert_weights: the k probabilities are rescaled to sum to 1 before they
        weight the outputs (Mixtral; Qwen3-MoE's and OLMoE's ``norm_topk_prob``);
        ``False``: used as the softmax gave them.
      shared_input_norm: with ``parallel_residual``, the MLP reads the attention's normed
        input: one norm per block, ``x + attn(norm(x)) + mlp(norm(x))`` (Phi-1/1.5/2; no
        ``mlp_norm``).
      head_bias: the output head adds a bias per token id (``lm_head_bias`` [V]; Phi). A
        reduced head of a draft (``draft_vocab_size``) has none.
      shared_expert_size: with ``num_experts``, a gated MLP of this width that every token
        runs beside its routed experts (``ws_gate``, ``ws_up``, ``ws_down``), its output
        scaled by ``sigmoid(x @ shared_gate)`` (``shared_gate`` [L, d, 1]) and added
        (Qwen2-MoE's shared expert); 0: none.
      learned_positions: a learned position embedding (``pos_embed``
        [max_position_embeddings, d]) is added to the token embedding, and no layer applies
        RoPE (``no_rope_layers`` must be ``(0,)``): GPTBigCode (StarCoder, SantaCoder).
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
    family: str | None = None
    qk_norm: bool = False
    qk_norm_whole: bool = False
    norm_plus_one: bool = False
    hidden_act: str = "silu"
    norm_kind: str = "rms"
    gated_mlp: bool = True
    parallel_residual: bool = False
    embed_scale: bool = False
    sandwich_norms: bool = False
    pre_norms: bool = True
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    rotary_dim: int | None = None
    no_rope_layers: tuple[int, ...] = ()
    embed_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_divisor: float | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    normalize_expert_weights: bool = True
    shared_expert_size: int = 0
    shared_input_norm: bool = False
    head_bias: bool = False
    learned_positions: bool = False
    logit_scale: float | None = None

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
        if self.rotary_dim is not None and (
                self.architecture != "llama" or not isinstance(self.rotary_dim, int)
                or isinstance(self.rotary_dim, bool) or self.rotary_dim % 2
                or not 0 < self.rotary_dim <= self.head_dim):
            raise InvalidArgumentError(
                f"rotary_dim must be an even int in (0, head_dim={self.head_dim}] on a llama "
                f"model, got {self.rotary_dim!r}")
        scaling = self.rope_scaling
        if (scaling is not None and scaling.kind == "longrope"
                and len(scaling.short_factor) != self.rope_dim // 2):
            raise InvalidArgumentError(
                f"longrope short_factor and long_factor need rotary dims / 2 = "
                f"{self.rope_dim // 2} entries, got {len(scaling.short_factor)}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise InvalidArgumentError(
                f"unknown hidden_act {self.hidden_act!r}; expected one of {HIDDEN_ACTS}")
        if any(not isinstance(w, int) or isinstance(w, bool) or w < 0
               for w in self.layer_windows):
            raise InvalidArgumentError(
                f"layer_windows must be ints >= 0 (0: a global layer), got "
                f"{self.layer_windows!r}")
        # Kept as its shortest period, so that a config with fewer or more layers (a draft
        # made of the first layers, a grown one) is still described, and equal configs
        # compare equal however the pattern was written.
        object.__setattr__(self, "layer_windows", _shortest_period(tuple(self.layer_windows)))
        if any(flag not in (0, 1) or isinstance(flag, bool) for flag in self.no_rope_layers):
            raise InvalidArgumentError(f"no_rope_layers must be 1 (RoPE) or 0 (none) per "
                                       f"layer, got {self.no_rope_layers!r}")
        for name in ("embed_multiplier", "residual_multiplier", "logits_divisor",
                     "logit_scale"):
            value = getattr(self, name)
            if value is not None and (self.architecture != "llama" or not value > 0
                                      or value == float("inf")):
                raise InvalidArgumentError(f"{name} must be a finite number > 0 on a llama "
                                           f"model, got {value!r}")
        if self.norm_kind not in NORM_KINDS:
            raise InvalidArgumentError(
                f"unknown norm_kind {self.norm_kind!r}; expected one of {NORM_KINDS}")
        if self.architecture != "llama" and (self.norm_kind != "rms" or not self.gated_mlp
                                             or self.parallel_residual):
            raise InvalidArgumentError("norm_kind, gated_mlp and parallel_residual describe "
                                       "llama-architecture models")
        if self.shared_input_norm and not self.parallel_residual:
            raise InvalidArgumentError("shared_input_norm applies with parallel_residual=True")
        if self.head_bias and self.architecture != "llama":
            raise InvalidArgumentError("head_bias describes llama-architecture models")
        if self.qk_norm_whole and not self.qk_norm:
            raise InvalidArgumentError("qk_norm_whole applies with qk_norm=True")
        if not self.pre_norms and (self.architecture != "llama" or not self.sandwich_norms):
            raise InvalidArgumentError("pre_norms=False needs a llama model with "
                                       "sandwich_norms=True (its only norms then)")
        if self.no_rope_layers and self.architecture != "llama":
            raise InvalidArgumentError("no_rope_layers apply to llama models (RoPE)")
        flags = _period(tuple(self.no_rope_layers))
        object.__setattr__(self, "no_rope_layers", () if set(flags) == {1} else flags)
        if self.learned_positions and self.no_rope_layers != (0,):
            raise InvalidArgumentError("learned_positions applies with no_rope_layers=(0,) "
                                       "(positions are learned, no layer applies RoPE)")
        if self.architecture != "llama" and self.family is not None:
            raise InvalidArgumentError(
                f"family {self.family!r} is a llama-architecture family, got "
                f"{self.architecture!r}")
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
        self._check_experts()
        if (not isinstance(self.draft_vocab_size, int)
                or not 0 <= self.draft_vocab_size <= self.vocab_size):
            raise InvalidArgumentError(f"draft_vocab_size must be an int in [0, "
                                       f"{self.vocab_size}], got {self.draft_vocab_size!r}")

    def _check_experts(self) -> None:
        experts, k = self.num_experts, self.experts_per_token
        for name, value in (("num_experts", experts), ("experts_per_token", k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}")
        shared = self.shared_expert_size
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise InvalidArgumentError(f"shared_expert_size must be an int >= 0, got {shared!r}")
        if not experts:
            if k or shared:
                raise InvalidArgumentError("experts_per_token and shared_expert_size apply with "
                                           "num_experts > 0")
            return
        if self.architecture != "llama" or not self.gated_mlp or self.mlp_bias:
            raise InvalidArgumentError("mixture-of-experts MLPs are gated MLPs without biases "
                                       "on a llama-architecture model")
        if not 1 <= k <= experts:
            raise InvalidArgumentError(f"experts_per_token must be in [1, num_experts="
                                       f"{experts}], got {k!r}")

    @property
    def rope_per_layer(self) -> tuple[bool, ...]:
        """Whether each layer applies RoPE (``no_rope_layers``)."""
        pattern = self.no_rope_layers or (1,)
        return tuple(bool(pattern[i % len(pattern)]) for i in range(self.num_layers))

    @property
    def rope_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (``rotary_dim``, else all)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def for_length(self, length: int) -> "ModelConfig":
        """The config a generation of ``length`` positions (prompt + ``max_new_tokens``)
        runs: with LongRoPE scaling, the long factors when ``length`` is past
        ``original_max_position_embeddings`` and the short ones otherwise (see
        :class:`RopeScaling`); any other config is returned as it is."""
        scaling = self.rope_scaling
        if scaling is None or scaling.kind != "longrope":
            return self
        long = length > scaling.original_max_position_embeddings
        if long == scaling.long:
            return self
        return dataclasses.replace(self, rope_scaling=dataclasses.replace(scaling, long=long))

    @property
    def windows_per_layer(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: global), from the ``layer_windows`` pattern."""
        pattern = self.layer_windows or (0,)
        return tuple(pattern[i % len(pattern)] for i in range(self.num_layers))

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
        if self.family == "gpt_neox":
            return _neox_to_hf(self)
        if self.family == "phi":
            return _phi_to_hf(self)
        if self.family == "starcoder2":
            return _starcoder2_to_hf(self)
        if self.family == "gpt_bigcode":
            return _bigcode_to_hf(self)
        if self.family in ("cohere", "cohere2"):
            return _cohere_to_hf(self)
        if self.family is not None:
            return _extended_to_hf(self)
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
            "eos_token_id": _eos_to_hf(self.eos_token_ids),
            "bos_token_id": self.bos_token_id,
        }
        if model_type == "llama":
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = self.mlp_bias
        if self.rope_scaling is not None:
            out["rope_scaling"] = _rope_scaling_to_hf(self.rope_scaling)
        return out


def _shortest_period(pattern: tuple) -> tuple:
    """The shortest prefix of ``pattern`` whose repetition gives ``pattern``; ``()`` for
    an all-global one."""
    return _period(pattern) if any(pattern) else ()


def _period(pattern: tuple) -> tuple:
    """The shortest prefix of ``pattern`` whose repetition gives ``pattern``."""
    for period in range(1, len(pattern) + 1):
        if all(pattern[i] == pattern[i % period] for i in range(len(pattern))):
            return pattern[:period]
    return pattern


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

_LLAMA_FAMILY = ("llama", "mistral", "qwen2", "smollm", "smollm2")


def _get(cfg: Mapping[str, Any], *names, default=None):
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _eos_to_hf(ids: tuple[int, ...]):
    """``eos_token_ids`` as a Hugging Face config writes ``eos_token_id``: a list of several,
    one id alone, or ``None``."""
    if len(ids) > 1:
        return list(ids)
    return ids[0] if ids else None


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
    if kind == "su":  # LongRoPE's name in early Phi-3 configs
        kind = "longrope"
    if kind not in ("llama3", "yarn", "longrope"):
        raise InvalidArgumentError(
            f"unsupported rope scaling type {kind!r}; specjax supports default, linear, "
            f"llama3, yarn and longrope")
    # As transformers reads it: a top-level original_max_position_embeddings (Phi-3's) first,
    # then the scaling's own, else max_position_embeddings.
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    original = int(_get(cfg, "original_max_position_embeddings",
                        default=merged.get("original_max_position_embeddings", max_positions)))
    try:
        if kind == "llama3":
            return theta, RopeScaling(
                "llama3", float(merged["factor"]), float(merged.get("low_freq_factor", 1.0)),
                float(merged.get("high_freq_factor", 4.0)), original)
        factor = merged.get("factor")
        factor = max_positions / original if factor is None else float(factor)
        attention = merged.get("attention_factor")
        if kind == "yarn":
            if attention is None:
                mscale, mscale_all_dim = merged.get("mscale"), merged.get("mscale_all_dim")
                attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                             if mscale and mscale_all_dim else _yarn_mscale(factor))
            return theta, RopeScaling(
                "yarn", factor, original_max_position_embeddings=original,
                beta_fast=float(merged.get("beta_fast") or 32),
                beta_slow=float(merged.get("beta_slow") or 1),
                truncate=bool(merged.get("truncate", True)), attention_factor=float(attention))
        if attention is None:
            attention = (1.0 if factor <= 1.0
                         else math.sqrt(1 + math.log(factor) / math.log(original)))
        return theta, RopeScaling(
            "longrope", factor, original_max_position_embeddings=original,
            attention_factor=float(attention), short_factor=merged.get("short_factor") or (),
            long_factor=merged.get("long_factor") or ())
    except KeyError as missing:
        raise InvalidArgumentError(f"{kind} rope scaling without {missing}") from None


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(factor) + 1`` (1 for
    ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
    if model_type == "gpt_neox":
        return _neox_from_hf(cfg)
    if model_type == "phi":
        return _phi_from_hf(cfg)
    if model_type == "starcoder2":
        return _starcoder2_from_hf(cfg)
    if model_type == "gpt_bigcode":
        return _bigcode_from_hf(cfg)
    if model_type in ("cohere", "cohere2"):
        return _cohere_from_hf(model_type, cfg)
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
    if model_type == "gemma3":  # the multimodal checkpoints: the text tower's config
        text = cfg.get("text_config")
        if not isinstance(text, Mapping):
            raise InvalidArgumentError("a gemma3 config without a text_config dict")
        return from_hf_config({"model_type": "gemma3_text", **text})
    if model_type in EXTENDED_FAMILIES:
        return _extended_from_hf(model_type, cfg)
    raise InvalidArgumentError(
        f"unsupported model_type {model_type!r}; specjax supports gpt2, gpt_bigcode, "
        f"gpt_neox, phi, starcoder2, cohere, cohere2, {', '.join(_LLAMA_FAMILY)}, "
        f"{', '.join(EXTENDED_FAMILIES)} and gemma3"
    )


# Families on the llama forward with the optional fields of ModelConfig.
EXTENDED_FAMILIES = ("qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "smollm3", "granite",
                     "olmo2", "olmo3", "stablelm", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")
_GEMMA = ("gemma", "gemma2", "gemma3_text")
# OLMo 2/3: norms on the attention and MLP outputs only, q and k normed over all heads.
_OLMO = ("olmo2", "olmo3")
_OLMO3_THETA = 500000.0
# Mixture-of-experts families: every block's MLP is a routed set of experts.
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _layer_windows(model_type: str, cfg: Mapping[str, Any], num_layers: int) -> tuple:
    """Per-layer sliding windows (0 = global) from ``layer_types`` or the older keys."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen3", "smollm3", "qwen2_moe", "qwen3_moe") and not cfg.get(
            "use_sliding_window", False):
        window = None
    if model_type == "olmo2":  # no sliding layers (an Olmo 3 config names olmo3)
        window = None
    if not window:
        return ()
    window = int(window)
    types = cfg.get("layer_types")
    if model_type == "phi3":  # one window for every layer
        sliding = [True] * num_layers
    elif types is not None:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != num_layers:
            raise InvalidArgumentError(
                f"{model_type} layer_types must be {num_layers} of sliding_attention / "
                f"full_attention, got {types!r}")
        sliding = [t == "sliding_attention" for t in types]
    elif model_type == "gemma2":  # even layers slide
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif model_type in ("gemma3_text", "cohere2"):  # pattern - 1 sliding layers, a global one
        pattern = int(_get(cfg, "sliding_window_pattern", "_sliding_window_pattern",
                           default=6 if model_type == "gemma3_text" else 4))
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif model_type == "olmo3":  # three sliding layers, then a global one
        sliding = [(i + 1) % 4 != 0 for i in range(num_layers)]
    else:
        sliding = [i >= int(cfg.get("max_window_layers", 0)) for i in range(num_layers)]
    windows = tuple(window if s else 0 for s in sliding)
    return windows if any(windows) else ()


def _gemma3_rope(cfg: Mapping[str, Any], local_default: float = 10000.0
                 ) -> tuple[float, RopeScaling | None, float]:
    """(global theta, global scaling, local theta) of a Gemma 3 or Olmo 3 config: nested
    ``rope_parameters`` per layer type (transformers >= 5) or ``rope_theta`` +
    ``rope_scaling`` + ``rope_local_base_freq`` (Gemma 3; Olmo 3's sliding layers take
    ``rope_theta`` without the scaling, ``local_default``)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = _rope_from_hf({"rope_parameters": params["full_attention"]})
        local, local_scaling = _rope_from_hf(
            {"rope_parameters": params.get("sliding_attention")
             or {"rope_theta": local_default}})
        if local_scaling is not None:
            raise InvalidArgumentError(
                f"{cfg.get('model_type', 'gemma3_text')}: rope scaling on the sliding layers "
                f"({local_scaling.kind!r}) is not supported")
        return theta, scaling, local
    theta, scaling = _rope_from_hf(cfg)
    if cfg.get("model_type") == "olmo3":
        return theta, scaling, theta
    return theta, scaling, float(cfg.get("rope_local_base_freq", local_default))


def _extended_from_hf(model_type: str, cfg: Mapping[str, Any]) -> ModelConfig:
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    gemma = model_type in _GEMMA
    act = _get(cfg, "hidden_activation", "hidden_act",
               default="gelu_pytorch_tanh" if gemma else "silu")
    olmo = model_type in _OLMO
    if model_type == "gemma" and act == "gelu":
        act = "gelu_tanh"  # the released Gemma configs' legacy name for it (transformers reads so)
    if model_type == "gemma" and cfg.get("use_bidirectional_attention"):
        raise InvalidArgumentError("gemma with use_bidirectional_attention (an embedding model) "
                                   "is not supported: specjax decodes causally")
    if gemma and act in _GELU_TANH + ("gelu_tanh",):
        act = "gelu_tanh"
    elif gemma or act != "silu":
        raise InvalidArgumentError(
            f"unsupported {model_type} activation {act!r}; expected "
            f"{'gelu_pytorch_tanh' if gemma else 'silu'}")
    for bias in ("attention_bias", "mlp_bias"):
        if bool(cfg.get(bias, False)):
            raise InvalidArgumentError(f"{model_type} with {bias} is not supported")
    stablelm = model_type == "stablelm"
    if stablelm:
        for key, what in (("use_parallel_residual", "parallel attention and MLP"),
                          ("qk_layernorm", "per-head q/k LayerNorms")):
            if cfg.get(key):
                raise InvalidArgumentError(f"stablelm with {key} ({what}, StableLM 2 12B) is "
                                           f"not supported")
    experts = _experts_from_hf(model_type, cfg)
    rope = dict(cfg.get("rope_parameters") or {})
    partial = float(_get(cfg, "partial_rotary_factor", default=rope.get(
        "partial_rotary_factor", 0.25 if stablelm else 1.0)))  # the config classes' defaults
    head_dim = int(_get(cfg, "head_dim", default=width // heads))
    rotary_dim = None
    if partial != 1.0:
        if model_type not in ("phi3", "stablelm"):
            raise InvalidArgumentError(
                f"{model_type} partial_rotary_factor {partial} is not supported (RoPE on the "
                f"whole head only)")
        rotary_dim = int(head_dim * partial)  # as transformers rounds it
    local_theta = None
    if model_type == "gemma3_text":
        theta, scaling, local_theta = _gemma3_rope(cfg)
    elif model_type == "olmo3":
        if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
            cfg = {**cfg, "rope_theta": _OLMO3_THETA}  # its config class's default
        theta, scaling, local_theta = _gemma3_rope(cfg, _OLMO3_THETA)
        if scaling is None and local_theta == theta:  # one set of tables serves both
            local_theta = None
    else:
        if model_type == "phi3":
            cfg = _phi3_rope_names(cfg)
        theta, scaling = _rope_from_hf(cfg)
    query_scale = None
    if gemma and cfg.get("query_pre_attn_scalar") is not None:
        query_scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
    if model_type == "granite":
        query_scale = float(cfg.get("attention_multiplier", head_dim ** -0.5))
    if query_scale == head_dim ** -0.5:
        query_scale = None
    granite = {key: float(cfg[key]) if model_type == "granite" and cfg.get(key) is not None
               and float(cfg[key]) != 1.0 else None
               for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling")}
    softcap = {name: float(cfg[name]) if gemma and cfg.get(name) is not None else None
               for name in ("attn_logit_softcapping", "final_logit_softcapping")}
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)), head_dim=head_dim,
        intermediate_size=int(cfg["moe_intermediate_size" if model_type in ("qwen2_moe",
                                                                            "qwen3_moe")
                                  else "intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(_get(cfg, "layer_norm_eps" if stablelm else "rms_norm_eps", default=(
            1e-5 if olmo or stablelm or model_type in ("mixtral", "olmoe") else 1e-6))),
        rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family=model_type, qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe",
                                                  *_OLMO),
        qk_norm_whole=olmo or model_type == "olmoe", pre_norms=not olmo,
        norm_plus_one=gemma, hidden_act=act, embed_scale=gemma,
        sandwich_norms=(gemma and model_type != "gemma") or olmo,
        query_scale=query_scale, attn_softcap=softcap["attn_logit_softcapping"],
        final_softcap=softcap["final_logit_softcapping"],
        layer_windows=_layer_windows(model_type, cfg, layers), local_rope_theta=local_theta,
        rotary_dim=rotary_dim, no_rope_layers=_no_rope_layers(model_type, cfg, layers),
        norm_kind="layer" if stablelm else "rms", qkv_bias=(stablelm and bool(
            cfg.get("use_qkv_bias", False))) or (model_type == "qwen2_moe" and bool(
                cfg.get("qkv_bias", True))),
        embed_multiplier=granite["embedding_multiplier"],
        residual_multiplier=granite["residual_multiplier"],
        logits_divisor=granite["logits_scaling"], **experts,
    )


def _experts_from_hf(model_type: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`ModelConfig` expert fields of a Mixtral, Qwen3-MoE or OLMoE config
    (``{}`` for the other families); what they hold that specjax does not run is refused
    in one line."""
    if model_type not in _MOE:
        return {}
    if model_type in ("qwen2_moe", "qwen3_moe") and (
            cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1):
        raise InvalidArgumentError(
            f"{model_type} with dense layers among the sparse ones (mlp_only_layers "
            f"{cfg.get('mlp_only_layers')!r}, decoder_sparse_step "
            f"{cfg.get('decoder_sparse_step')!r}) is not supported: every layer must be sparse")
    if model_type == "olmoe" and cfg.get("clip_qkv") is not None:
        raise InvalidArgumentError(f"olmoe with clip_qkv ({cfg['clip_qkv']}) is not supported")
    experts = _get(cfg, "num_local_experts", "num_experts")
    if experts is None or cfg.get("num_experts_per_tok") is None:
        raise InvalidArgumentError(f"a {model_type} config needs num_experts "
                                   f"(num_local_experts) and num_experts_per_tok")
    return dict(num_experts=int(experts), experts_per_token=int(cfg["num_experts_per_tok"]),
                normalize_expert_weights=model_type == "mixtral" or bool(
                    cfg.get("norm_topk_prob", False)),
                shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                if model_type == "qwen2_moe" else 0)


def _no_rope_layers(model_type: str, cfg: Mapping[str, Any], num_layers: int) -> tuple:
    """SmolLM3's per-layer RoPE flags (``no_rope_layers``, else a NoPE layer every
    ``no_rope_layer_interval``, as transformers fills them in); ``()`` for the others."""
    if model_type != "smollm3":
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(flags, (list, tuple)) or len(flags) != num_layers:
        raise InvalidArgumentError(f"smollm3 no_rope_layers must hold one 0/1 flag per layer "
                                   f"({num_layers}), got {flags!r}")
    return tuple(int(f) if f in (0, 1) else f for f in flags)


def _phi3_rope_names(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Phi-3 config with its scaling's older names ("su", "yarn") read as transformers'
    Phi-3 reads them: LongRoPE."""
    out = dict(cfg)
    for key in ("rope_scaling", "rope_parameters"):
        scaling = out.get(key)
        if isinstance(scaling, Mapping):
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind in ("su", "yarn"):
                out[key] = {**scaling, "rope_type": "longrope", "type": "longrope"}
    return out


# GPT-NeoX's activations by their Hugging Face names (the tanh forms are one function).
_NEOX_ACTS = {"gelu": "gelu", **{name: "gelu_tanh" for name in _GELU_TANH + ("gelu_fast",)}}


def _neox_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """GPT-NeoX (Pythia, GPT-NeoX-20B) on the llama forward: LayerNorm with biases, q|k|v
    with biases, RoPE on the first ``rotary_pct`` of each head, a two-matrix GELU MLP,
    parallel residual (``use_parallel_residual``), an untied head."""
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    act = cfg.get("hidden_act", "gelu")
    if act not in _NEOX_ACTS:
        raise InvalidArgumentError(f"unsupported gpt_neox activation {act!r}; expected one of "
                                   f"{sorted(_NEOX_ACTS)}")
    rope = dict(cfg.get("rope_parameters") or {})
    partial = float(_get(cfg, "partial_rotary_factor", "rotary_pct",
                         default=rope.get("partial_rotary_factor", 1.0)))
    if "rope_theta" not in cfg and "rope_theta" not in rope:
        cfg = {**cfg, "rope_theta": float(cfg.get("rotary_emb_base", 10000.0))}
    theta, scaling = _rope_from_hf(cfg)
    head_dim = width // heads
    bias = bool(cfg.get("attention_bias", True))
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=int(cfg["num_hidden_layers"]), num_heads=heads, num_kv_heads=heads,
        head_dim=head_dim, intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias, out_bias=bias, mlp_bias=True,
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family="gpt_neox", hidden_act=_NEOX_ACTS[act], norm_kind="layer", gated_mlp=False,
        parallel_residual=bool(cfg.get("use_parallel_residual", True)),
        rotary_dim=None if partial == 1.0 else int(head_dim * partial))


def _phi_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """Phi-1, 1.5 and 2 on the llama forward: GPT-NeoX's parallel block with one LayerNorm
    that attention and MLP both read, biases on every projection, the tanh GELU, RoPE on the
    first ``partial_rotary_factor`` of each head, a head with a bias. The per-head q/k
    LayerNorms of ``qk_layernorm`` (no released checkpoint has them) are refused."""
    if cfg.get("qk_layernorm"):
        raise InvalidArgumentError("phi with qk_layernorm (per-head q/k LayerNorms) is not "
                                   "supported")
    act = cfg.get("hidden_act", "gelu_new")
    if act not in _GELU_TANH + ("gelu_fast",):
        raise InvalidArgumentError(f"unsupported phi activation {act!r}; expected gelu_new")
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    head_dim = width // heads
    rope = dict(cfg.get("rope_parameters") or {})
    partial = float(_get(cfg, "partial_rotary_factor",
                         default=rope.get("partial_rotary_factor", 0.5)))
    theta, scaling = _rope_from_hf(cfg)
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)), head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True, out_bias=True, mlp_bias=True,
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family="phi", hidden_act="gelu_tanh", norm_kind="layer", gated_mlp=False,
        parallel_residual=True, shared_input_norm=True, head_bias=True,
        rotary_dim=None if partial == 1.0 else int(head_dim * partial))


def _hf_keys(config: ModelConfig, model_type: str, architecture: str, **family) -> dict:
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
        "eos_token_id": _eos_to_hf(config.eos_token_ids), "bos_token_id": config.bos_token_id,
        **family,
    }
    if config.rope_scaling is not None:
        out["rope_scaling"] = _rope_scaling_to_hf(config.rope_scaling)
    return out


def _phi_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a ``phi`` model (the keys :func:`_phi_from_hf` reads)."""
    return _hf_keys(config, "phi", "PhiForCausalLM", hidden_act="gelu_new",
                    layer_norm_eps=config.norm_eps, qk_layernorm=False,
                    partial_rotary_factor=config.rope_dim / config.head_dim)


def _refuse_partial_rope(model_type: str, cfg: Mapping[str, Any]) -> None:
    """Raises :class:`InvalidArgumentError` if ``cfg`` asks for RoPE on part of each head
    (``partial_rotary_factor``), which ``model_type``'s transformers class does not do."""
    rope = dict(cfg.get("rope_parameters") or {})
    if float(_get(cfg, "partial_rotary_factor", default=rope.get("partial_rotary_factor", 1.0))
             ) != 1.0:
        raise InvalidArgumentError(f"{model_type} with RoPE on part of each head "
                                   f"(partial_rotary_factor) is not supported")


def _starcoder2_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """StarCoder2 on the llama forward: pre-norm sequential blocks with LayerNorms (weights
    and biases), grouped KV heads, RoPE on the whole head, a two-matrix tanh-GELU MLP
    (``c_fc``, ``c_proj``), biases on every projection when ``use_bias``, the head tied to
    the embedding unless ``tie_word_embeddings`` is false; ``sliding_window`` slides every
    layer."""
    act = cfg.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _NEOX_ACTS:
        raise InvalidArgumentError(f"unsupported starcoder2 activation {act!r}; expected one "
                                   f"of {sorted(_NEOX_ACTS)}")
    _refuse_partial_rope("starcoder2", cfg)
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    theta, scaling = _rope_from_hf(cfg)
    bias = bool(cfg.get("use_bias", True))
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=width // heads, intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        norm_eps=float(_get(cfg, "norm_epsilon", "layer_norm_eps", default=1e-5)),
        rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bias, out_bias=bias, mlp_bias=bias,
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family="starcoder2", hidden_act=_NEOX_ACTS[act], norm_kind="layer", gated_mlp=False,
        layer_windows=(int(window),) * layers if window else ())


def _starcoder2_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a ``starcoder2`` model (the keys
    :func:`_starcoder2_from_hf` reads)."""
    return _hf_keys(config, "starcoder2", "Starcoder2ForCausalLM",
                    hidden_act="gelu" if config.hidden_act == "gelu" else "gelu_pytorch_tanh",
                    norm_epsilon=config.norm_eps, use_bias=config.qkv_bias,
                    sliding_window=max(config.windows_per_layer) or None)


def _bigcode_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """GPTBigCode (StarCoder, StarCoderBase, SantaCoder) on the llama forward: GPT-2's block
    (LayerNorms with biases, biases on every projection, a two-matrix GELU MLP, learned
    positions, no RoPE) with one KV head when ``multi_query`` (else one per head), the head
    tied unless ``tie_word_embeddings`` is false; ``scale_attn_weights=False`` scores
    without the ``1/sqrt(D)``."""
    act = cfg.get("activation_function", "gelu_pytorch_tanh")
    if act not in _NEOX_ACTS:
        raise InvalidArgumentError(f"unsupported gpt_bigcode activation {act!r}; expected one "
                                   f"of {sorted(_NEOX_ACTS)}")
    width = int(_get(cfg, "n_embd", "hidden_size"))
    heads = int(_get(cfg, "n_head", "num_attention_heads"))
    if width % heads:
        raise InvalidArgumentError(f"gpt_bigcode n_head ({heads}) does not divide n_embd "
                                   f"({width})")
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=int(_get(cfg, "n_layer", "num_hidden_layers")), num_heads=heads,
        num_kv_heads=1 if cfg.get("multi_query", True) else heads, head_dim=width // heads,
        intermediate_size=int(_get(cfg, "n_inner", "intermediate_size", default=4 * width)),
        max_position_embeddings=int(_get(cfg, "n_positions", "max_position_embeddings",
                                         default=1024)),
        norm_eps=float(_get(cfg, "layer_norm_epsilon", "layer_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=True, out_bias=True, mlp_bias=True,
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family="gpt_bigcode", hidden_act=_NEOX_ACTS[act], norm_kind="layer", gated_mlp=False,
        query_scale=None if cfg.get("scale_attn_weights", True) else 1.0,
        no_rope_layers=(0,), learned_positions=True)


def _bigcode_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a ``gpt_bigcode`` model (the keys :func:`_bigcode_from_hf`
    reads)."""
    if config.num_kv_heads not in (1, config.num_heads):
        raise InvalidArgumentError(f"a gpt_bigcode model has one KV head or one per head, got "
                                   f"{config.num_kv_heads} of {config.num_heads}")
    return {
        "model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"],
        "vocab_size": config.vocab_size, "n_embd": config.hidden_size,
        "n_layer": config.num_layers, "n_head": config.num_heads,
        "multi_query": config.num_kv_heads == 1 and config.num_heads > 1,
        "n_inner": config.intermediate_size, "n_positions": config.max_position_embeddings,
        "activation_function": "gelu" if config.hidden_act == "gelu" else "gelu_pytorch_tanh",
        "layer_norm_epsilon": config.norm_eps,
        "scale_attn_weights": config.query_scale is None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": _eos_to_hf(config.eos_token_ids), "bos_token_id": config.bos_token_id,
    }


def _cohere_from_hf(model_type: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """Command R (``cohere``) and Command R7B (``cohere2``) on the llama forward: one
    LayerNorm without a bias that attention and a SwiGLU MLP both read side by side, RoPE
    on adjacent pairs of each head (the key map reorders q's and k's rows per head into
    the halves this forward rotates: the scores are the same sums), logits times
    ``logit_scale``, a tied head. ``cohere2``: three sliding-window layers per global one
    (``layer_types``), RoPE in the sliding layers only. Command R+'s per-head q/k norms
    (``use_qk_norm``) are refused."""
    if cfg.get("use_qk_norm"):
        raise InvalidArgumentError(f"{model_type} with use_qk_norm (per-head q/k LayerNorms) "
                                   f"is not supported")
    _refuse_partial_rope(model_type, cfg)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise InvalidArgumentError(f"unsupported {model_type} activation {act!r}; expected silu")
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    theta, scaling = _rope_from_hf(cfg)
    bias = bool(cfg.get("attention_bias", False))
    windows, no_rope = (), ()
    if model_type == "cohere2":
        # A layer applies RoPE where it slides (transformers' Cohere2Attention rotates only
        # where its window is set): without a window, no layer does.
        windows = _layer_windows(model_type, cfg, layers)
        no_rope = tuple(int(w > 0) for w in windows) or (0,)
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_get(cfg, "head_dim", default=width // heads)),
        intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        norm_eps=float(_get(cfg, "layer_norm_eps", default=1e-5)), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bias, out_bias=bias, mlp_bias=False,
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family=model_type, norm_kind="layer_nobias", parallel_residual=True,
        shared_input_norm=True, logit_scale=float(_get(cfg, "logit_scale", default=0.0625)),
        layer_windows=windows, no_rope_layers=no_rope)


def _cohere_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a ``cohere`` or ``cohere2`` model (the keys
    :func:`_cohere_from_hf` reads)."""
    cohere2 = config.family == "cohere2"
    windows = config.windows_per_layer
    layout = dict(layer_types=["sliding_attention" if w else "full_attention" for w in windows],
                  sliding_window=max(windows) or None) if cohere2 else {}
    return _hf_keys(config, config.family,
                    "Cohere2ForCausalLM" if cohere2 else "CohereForCausalLM",
                    head_dim=config.head_dim, hidden_act="silu", layer_norm_eps=config.norm_eps,
                    attention_bias=config.qkv_bias, logit_scale=config.logit_scale,
                    use_qk_norm=False, **layout)


def _neox_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a ``gpt_neox`` model (the keys :func:`_neox_from_hf`
    reads)."""
    out: dict[str, Any] = {
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "gelu" if config.hidden_act == "gelu" else "gelu_new",
        "max_position_embeddings": config.max_position_embeddings,
        "layer_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
        "partial_rotary_factor": config.rope_dim / config.head_dim,
        "use_parallel_residual": config.parallel_residual,
        "attention_bias": config.qkv_bias, "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": _eos_to_hf(config.eos_token_ids),
        "bos_token_id": config.bos_token_id,
    }
    if config.rope_scaling is not None:
        out["rope_scaling"] = _rope_scaling_to_hf(config.rope_scaling)
    return out


def _extended_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a :data:`EXTENDED_FAMILIES` model (the keys
    :func:`_extended_from_hf` reads)."""
    family = config.family
    arch = {"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
            "gemma": "GemmaForCausalLM",
            "smollm3": "SmolLM3ForCausalLM", "granite": "GraniteForCausalLM",
            "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
            "stablelm": "StableLmForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[family]
    out: dict[str, Any] = {
        "model_type": family, "architectures": [arch], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False,
        "eos_token_id": _eos_to_hf(config.eos_token_ids),
        "bos_token_id": config.bos_token_id,
    }
    if family == "gemma":  # Gemma 1: GeGLU, (1 + w) norms, scaled embeddings and nothing more
        out["hidden_act"] = "gelu_pytorch_tanh"
    elif family in _GEMMA:
        out["hidden_activation"] = "gelu_pytorch_tanh"
        scalar = (config.head_dim if config.query_scale is None
                  else round(config.query_scale ** -2, 6))
        out["query_pre_attn_scalar"] = int(scalar) if scalar == int(scalar) else scalar
        out["attn_logit_softcapping"] = config.attn_softcap
        out["final_logit_softcapping"] = config.final_softcap
    else:
        out["hidden_act"] = "silu"
    if family == "gemma3_text":
        out["rope_local_base_freq"] = config.local_rope_theta
    windows = config.windows_per_layer if config.layer_windows else ()
    if windows:
        out["sliding_window"] = max(windows)
        if family != "phi3":
            out["layer_types"] = ["sliding_attention" if w else "full_attention"
                                  for w in windows]
        if family in ("qwen3", "smollm3", "qwen2_moe", "qwen3_moe"):
            out["use_sliding_window"] = True
    elif family in _GEMMA and family != "gemma":
        # Gemma configs always slide some layers: a window past every position is global.
        out["sliding_window"] = config.max_position_embeddings
    if family == "olmo3":  # per layer type; the scaling is the global layers' only
        full = {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.rope_scaling is not None:
            full = {**_rope_scaling_to_hf(config.rope_scaling), "rope_theta": config.rope_theta}
        local = config.rope_theta if config.local_rope_theta is None else config.local_rope_theta
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": local}}
        out.pop("rope_theta")
    elif config.rope_scaling is not None:
        out["rope_scaling"] = _rope_scaling_to_hf(config.rope_scaling)
        if family == "phi3":  # transformers' Phi-3 reads this key before the scaling's own
            out["original_max_position_embeddings"] = (
                config.rope_scaling.original_max_position_embeddings)
    if config.rotary_dim is not None:
        out["partial_rotary_factor"] = config.rotary_dim / config.head_dim
    if family == "smollm3":
        out["no_rope_layers"] = [int(flag) for flag in config.rope_per_layer]
    if family in ("smollm3", "granite"):
        out["mlp_bias"] = False
    if family == "stablelm":
        out.update(layer_norm_eps=out.pop("rms_norm_eps"), use_qkv_bias=config.qkv_bias,
                   partial_rotary_factor=config.rope_dim / config.head_dim,
                   use_parallel_residual=False, qk_layernorm=False)
    if family == "granite":
        out.update(
            attention_multiplier=(config.head_dim ** -0.5 if config.query_scale is None
                                  else config.query_scale),
            embedding_multiplier=config.embed_multiplier or 1.0,
            residual_multiplier=config.residual_multiplier or 1.0,
            logits_scaling=config.logits_divisor or 1.0)
    if family in _MOE:
        out.update(num_experts_per_tok=config.experts_per_token,
                   **{"num_local_experts" if family == "mixtral" else "num_experts":
                      config.num_experts})
        if family != "mixtral":
            out["norm_topk_prob"] = config.normalize_expert_weights
        if family in ("qwen2_moe", "qwen3_moe"):
            out.update(moe_intermediate_size=out["intermediate_size"], decoder_sparse_step=1,
                       mlp_only_layers=[])
        if family == "qwen2_moe":
            out.update(shared_expert_intermediate_size=config.shared_expert_size,
                       qkv_bias=config.qkv_bias)
    return out


def _rope_scaling_to_hf(scaling: RopeScaling) -> dict[str, Any]:
    out = {"rope_type": scaling.kind, "factor": scaling.factor}
    if scaling.kind != "linear":
        out["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    if scaling.kind == "llama3":
        out.update(low_freq_factor=scaling.low_freq_factor,
                   high_freq_factor=scaling.high_freq_factor)
    if scaling.kind == "yarn":
        out.update(beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow,
                   truncate=scaling.truncate, attention_factor=scaling.attention_factor)
    if scaling.kind == "longrope":
        out.update(attention_factor=scaling.attention_factor,
                   short_factor=list(scaling.short_factor), long_factor=list(scaling.long_factor))
    return out
