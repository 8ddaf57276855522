"""Model configuration: a small, frozen, hashable dataclass that is static under ``jit``.

One :class:`ModelConfig` describes every architecture specjax runs. ``architecture`` picks
the forward function (``"llama"``: the shared decoder, :mod:`specjax.models.decoder`, which
runs every family but GPT-2 with the optional fields below; ``"gpt2"``: GPT-2);
:class:`~specjax.rope_scaling.RopeScaling` covers the long-context RoPE variants (linear,
Llama 3, YaRN, LongRoPE). Presets are factory functions. Each family's Hugging Face config
in and out lives in its module of :mod:`specjax.families` (``from_hf_config``,
``to_hf_config``), so a model can round-trip through an HF directory.
"""

from __future__ import annotations

import dataclasses

from specjax.errors import InvalidArgumentError
from specjax.rope_scaling import RopeScaling

ARCHITECTURES = ("llama", "gpt2")
HIDDEN_ACTS = ("silu", "gelu_tanh", "gelu")
NORM_KINDS = ("rms", "layer", "layer_nobias")


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
