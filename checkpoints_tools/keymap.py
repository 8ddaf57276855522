"""Declarative, strict mapping between Hugging Face tensor names and specjax parameters.

A rule table lists, for each HF tensor name pattern, the specjax leaf (or leaves) it fills
and the transform that gets it there (``T``: transpose an HF ``[out, in]`` Linear weight to
our ``[in, out]``). Per-layer tensors carry ``{i}`` in the pattern and fill row ``i`` of a
stacked ``[L, ...]`` leaf; a mixture of experts' tensors carry ``{e}`` too and fill row
``[i, e]`` of an ``[L, E, ...]`` leaf.

:func:`params_from_hf_tensors` fails with a :class:`CheckpointError` naming the tensor on
any unmapped, duplicated, missing or mis-shaped tensor. :func:`hf_tensors_from_params` is
the inverse (used to export a draft as an HF directory).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping

import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError
from specjax.models import param_shapes


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF tensor -> one or more specjax leaves.

    Attributes:
      hf_name: the HF tensor name; ``{i}`` stands for the layer index.
      leaves: specjax leaf paths ("layers/wq"); several when one HF tensor is split.
      to_ours: HF array -> tuple of arrays, one per leaf (per layer for layer leaves).
      to_hf: inverse of ``to_ours``.
    """

    hf_name: str
    leaves: tuple[str, ...]
    to_ours: Callable = lambda a: (a,)
    to_hf: Callable = lambda *a: a[0]


def _t(leaf: str, hf_name: str) -> Rule:
    """A Linear weight stored ``[out, in]`` by HF and ``[in, out]`` by us."""
    return Rule(hf_name, (leaf,), lambda a: (a.T,), lambda a: a.T)


def _same(leaf: str, hf_name: str) -> Rule:
    return Rule(hf_name, (leaf,))


def llama_rules(config: ModelConfig) -> list[Rule]:
    """Rules for LlamaForCausalLM-style checkpoints (Llama, Mistral, Qwen2, SmolLM)."""
    p = "model.layers.{i}."
    rules = [
        _same("embed", "model.embed_tokens.weight"),
        _same("final_norm", "model.norm.weight"),
        _same("layers/attn_norm", p + "input_layernorm.weight"),
        _same("layers/mlp_norm", p + "post_attention_layernorm.weight"),
        _t("layers/wq", p + "self_attn.q_proj.weight"),
        _t("layers/wk", p + "self_attn.k_proj.weight"),
        _t("layers/wv", p + "self_attn.v_proj.weight"),
        _t("layers/wo", p + "self_attn.o_proj.weight"),
        _t("layers/w_gate", p + "mlp.gate_proj.weight"),
        _t("layers/w_up", p + "mlp.up_proj.weight"),
        _t("layers/w_down", p + "mlp.down_proj.weight"),
    ]
    if config.qkv_bias:
        rules += [_same("layers/bq", p + "self_attn.q_proj.bias"),
                  _same("layers/bk", p + "self_attn.k_proj.bias"),
                  _same("layers/bv", p + "self_attn.v_proj.bias")]
    if config.out_bias:
        rules.append(_same("layers/bo", p + "self_attn.o_proj.bias"))
    if config.mlp_bias:
        rules += [_same("layers/b_gate", p + "mlp.gate_proj.bias"),
                  _same("layers/b_up", p + "mlp.up_proj.bias"),
                  _same("layers/b_down", p + "mlp.down_proj.bias")]
    if not config.tie_word_embeddings:
        rules.append(_t("lm_head", "lm_head.weight"))
    return rules


def _t_split(leaves: tuple[str, ...], hf_name: str, widths: tuple[int, ...]) -> Rule:
    """A fused Linear weight ``[sum(widths), in]`` split into ``[in, width]`` leaves."""
    bounds = np.cumsum(widths)[:-1]
    return Rule(hf_name, leaves, lambda a: tuple(np.split(a.T, bounds, axis=-1)),
                lambda *parts: np.concatenate(parts, axis=-1).T)


def family_rules(config: ModelConfig) -> list[Rule]:
    """Rules for the :data:`specjax.families.extended.FAMILIES` checkpoints: Llama's names
    with the differences of each family."""
    p = "model.layers.{i}."
    rules = [rule for rule in llama_rules(config) if config.family != "phi3" or not (
        rule.leaves[0] in ("layers/wq", "layers/wk", "layers/wv", "layers/w_gate", "layers/w_up"))]
    if config.family == "phi3":  # fused q|k|v and gate|up in the checkpoint
        q_width = config.num_heads * config.head_dim
        kv_width = config.num_kv_heads * config.head_dim
        f = config.intermediate_size
        rules += [_t_split(("layers/wq", "layers/wk", "layers/wv"),
                           p + "self_attn.qkv_proj.weight", (q_width, kv_width, kv_width)),
                  _t_split(("layers/w_gate", "layers/w_up"), p + "mlp.gate_up_proj.weight",
                           (f, f))]
    if config.norm_kind == "layer":  # StableLM: LayerNorms with biases
        rules += [rule for rule in _layer_norm_rules(
            ("final_norm", "model.norm"), ("layers/attn_norm", p + "input_layernorm"),
            ("layers/mlp_norm", p + "post_attention_layernorm")) if rule.hf_name.endswith("bias")]
    if config.qk_norm:
        rules += [_same("layers/q_norm", p + "self_attn.q_norm.weight"),
                  _same("layers/k_norm", p + "self_attn.k_norm.weight")]
    if config.num_experts:  # Mixtral, Qwen3-MoE, OLMoE: a router and E experts per layer
        rules = [rule for rule in rules
                 if rule.leaves[0] not in ("layers/w_gate", "layers/w_up", "layers/w_down")]
        rules += _expert_rules(config)
    if config.sandwich_norms:  # Gemma: post_attention_layernorm is the attention output's
        rules = [rule for rule in rules
                 if rule.leaves not in (("layers/mlp_norm",), ("layers/attn_norm",))]
        rules += [_same("layers/post_attn_norm", p + "post_attention_layernorm.weight"),
                  _same("layers/post_mlp_norm", p + "post_feedforward_layernorm.weight")]
        if config.pre_norms:  # OLMo 2/3 have none: their only norms are the two above
            rules += [_same("layers/attn_norm", p + "input_layernorm.weight"),
                      _same("layers/mlp_norm", p + "pre_feedforward_layernorm.weight")]
    return rules


def _expert_rules(config: ModelConfig) -> list[Rule]:
    """The router and experts of a mixture-of-experts layer, as the released checkpoints
    name them (one tensor per expert; transformers 5 stacks them in memory but writes them
    back this way)."""
    if config.family == "mixtral":
        p = "model.layers.{i}.block_sparse_moe."
        names = ("w1", "w3", "w2")
    else:
        p = "model.layers.{i}.mlp."
        names = ("gate_proj", "up_proj", "down_proj")
    rules = [_t("layers/router", p + "gate.weight")] + [
        _t(leaf, p + "experts.{e}." + name + ".weight")
        for leaf, name in zip(("layers/we_gate", "layers/we_up", "layers/we_down"), names)]
    if config.shared_expert_size:  # Qwen2-MoE
        rules += [_t("layers/ws_gate", p + "shared_expert.gate_proj.weight"),
                  _t("layers/ws_up", p + "shared_expert.up_proj.weight"),
                  _t("layers/ws_down", p + "shared_expert.down_proj.weight"),
                  _t("layers/shared_gate", p + "shared_expert_gate.weight")]
    return rules


def gpt2_rules(config: ModelConfig) -> list[Rule]:
    """Rules for GPT2LMHeadModel checkpoints (HF ``Conv1D`` weights are already [in, out])."""
    p = "h.{i}."

    def split3(a):
        return tuple(np.split(a, 3, axis=-1))

    def join3(q, k, v):
        return np.concatenate([q, k, v], axis=-1)

    return [
        _same("embed", "wte.weight"),
        _same("pos_embed", "wpe.weight"),
        _same("final_norm_scale", "ln_f.weight"),
        _same("final_norm_bias", "ln_f.bias"),
        _same("layers/ln1_scale", p + "ln_1.weight"),
        _same("layers/ln1_bias", p + "ln_1.bias"),
        _same("layers/ln2_scale", p + "ln_2.weight"),
        _same("layers/ln2_bias", p + "ln_2.bias"),
        Rule(p + "attn.c_attn.weight", ("layers/wq", "layers/wk", "layers/wv"), split3, join3),
        Rule(p + "attn.c_attn.bias", ("layers/bq", "layers/bk", "layers/bv"), split3, join3),
        _same("layers/wo", p + "attn.c_proj.weight"),
        _same("layers/bo", p + "attn.c_proj.bias"),
        _same("layers/w_fc", p + "mlp.c_fc.weight"),
        _same("layers/b_fc", p + "mlp.c_fc.bias"),
        _same("layers/w_proj", p + "mlp.c_proj.weight"),
        _same("layers/b_proj", p + "mlp.c_proj.bias"),
    ]


def _layer_norm_rules(*norms: tuple[str, str]) -> list[Rule]:
    """A LayerNorm's two rules per (leaf, HF module): ``.weight`` to the leaf, ``.bias`` to
    the leaf + ``_bias``."""
    return [rule for leaf, module in norms
            for rule in (_same(leaf, module + ".weight"), _same(leaf + "_bias", module + ".bias"))]


def _per_head_qkv_rules(config: ModelConfig, module: str) -> tuple[Rule, Rule]:
    """The weight and bias rules of a Linear whose output rows interleave q, k and v per
    head, [H, 3 (q, k, v), D] (GPT-NeoX's ``query_key_value``, GPTBigCode's ``c_attn``
    without multi-query)."""
    heads, dim = config.num_heads, config.head_dim

    def split_weight(a):  # [H*3*D, d] -> three [d, H*D]
        a = a.reshape(heads, 3, dim, -1)
        return tuple(a[:, j].reshape(heads * dim, -1).T for j in range(3))

    def join_weight(*parts):
        return np.stack([part.T.reshape(heads, dim, -1) for part in parts], axis=1).reshape(
            heads * 3 * dim, -1)

    def split_bias(a):
        a = a.reshape(heads, 3, dim)
        return tuple(a[:, j].reshape(-1) for j in range(3))

    def join_bias(*parts):
        return np.stack([part.reshape(heads, dim) for part in parts], axis=1).reshape(-1)

    return (Rule(module + ".weight", ("layers/wq", "layers/wk", "layers/wv"), split_weight,
                 join_weight),
            Rule(module + ".bias", ("layers/bq", "layers/bk", "layers/bv"), split_bias,
                 join_bias))


def neox_rules(config: ModelConfig) -> list[Rule]:
    """Rules for GPTNeoXForCausalLM checkpoints (Pythia). Their ``query_key_value`` rows
    interleave the heads, [H, 3 (q, k, v), D], rather than stacking q, k and v."""
    p = "gpt_neox.layers.{i}."
    qkv_weight, qkv_bias = _per_head_qkv_rules(config, p + "attention.query_key_value")
    rules = [
        _same("embed", "gpt_neox.embed_in.weight"),
        *_layer_norm_rules(("final_norm", "gpt_neox.final_layer_norm"),
                           ("layers/attn_norm", p + "input_layernorm"),
                           ("layers/mlp_norm", p + "post_attention_layernorm")),
        qkv_weight,
        _t("layers/wo", p + "attention.dense.weight"),
        _t("layers/w_up", p + "mlp.dense_h_to_4h.weight"),
        _same("layers/b_up", p + "mlp.dense_h_to_4h.bias"),
        _t("layers/w_down", p + "mlp.dense_4h_to_h.weight"),
        _same("layers/b_down", p + "mlp.dense_4h_to_h.bias"),
    ]
    if config.qkv_bias:
        rules += [qkv_bias, _same("layers/bo", p + "attention.dense.bias")]
    if not config.tie_word_embeddings:
        rules.append(_t("lm_head", "embed_out.weight"))
    return rules


def phi_rules(config: ModelConfig) -> list[Rule]:
    """Rules for PhiForCausalLM checkpoints (Phi-1, 1.5, 2): one LayerNorm per block,
    ``dense`` for the attention's output, ``fc1``/``fc2`` for the MLP, biases everywhere,
    the head's included."""
    p = "model.layers.{i}."
    rules = [
        _same("embed", "model.embed_tokens.weight"),
        *_layer_norm_rules(("final_norm", "model.final_layernorm"),
                           ("layers/attn_norm", p + "input_layernorm")),
        *[rule for leaf, name in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"),
                                  ("o", "dense"))
          for rule in (_t(f"layers/w{leaf}", f"{p}self_attn.{name}.weight"),
                       _same(f"layers/b{leaf}", f"{p}self_attn.{name}.bias"))],
        _t("layers/w_up", p + "mlp.fc1.weight"), _same("layers/b_up", p + "mlp.fc1.bias"),
        _t("layers/w_down", p + "mlp.fc2.weight"), _same("layers/b_down", p + "mlp.fc2.bias"),
        _same("lm_head_bias", "lm_head.bias"),
    ]
    if not config.tie_word_embeddings:
        rules.append(_t("lm_head", "lm_head.weight"))
    return rules


def starcoder2_rules(config: ModelConfig) -> list[Rule]:
    """Rules for Starcoder2ForCausalLM checkpoints: Llama's attention names, LayerNorms
    with biases, ``c_fc``/``c_proj`` for the MLP, projection biases when ``use_bias``."""
    p = "model.layers.{i}."
    rules = [
        _same("embed", "model.embed_tokens.weight"),
        *_layer_norm_rules(("final_norm", "model.norm"),
                           ("layers/attn_norm", p + "input_layernorm"),
                           ("layers/mlp_norm", p + "post_attention_layernorm")),
        *[_t(f"layers/w{leaf}", f"{p}self_attn.{leaf}_proj.weight") for leaf in "qkvo"],
        _t("layers/w_up", p + "mlp.c_fc.weight"), _t("layers/w_down", p + "mlp.c_proj.weight"),
    ]
    if config.qkv_bias:
        rules += [_same(f"layers/b{leaf}", f"{p}self_attn.{leaf}_proj.bias") for leaf in "qkvo"]
        rules += [_same("layers/b_up", p + "mlp.c_fc.bias"),
                  _same("layers/b_down", p + "mlp.c_proj.bias")]
    if not config.tie_word_embeddings:
        rules.append(_t("lm_head", "lm_head.weight"))
    return rules


def bigcode_rules(config: ModelConfig) -> list[Rule]:
    """Rules for GPTBigCodeForCausalLM checkpoints (StarCoder, SantaCoder): GPT-2's names
    under ``transformer.``, Linear weights ([out, in]), ``c_attn`` rows q | k | v with one
    KV head (multi-query), or interleaved per head as GPT-NeoX's without."""
    p = "transformer.h.{i}."
    if config.num_kv_heads == config.num_heads and config.num_heads > 1:
        qkv_weight, qkv_bias = _per_head_qkv_rules(config, p + "attn.c_attn")
    else:
        widths = (config.num_heads * config.head_dim,) + (config.head_dim,) * 2
        bounds = np.cumsum(widths)[:-1]
        qkv_weight = _t_split(("layers/wq", "layers/wk", "layers/wv"), p + "attn.c_attn.weight",
                              widths)
        qkv_bias = Rule(p + "attn.c_attn.bias", ("layers/bq", "layers/bk", "layers/bv"),
                        lambda a: tuple(np.split(a, bounds)), lambda *parts: np.concatenate(parts))
    rules = [
        _same("embed", "transformer.wte.weight"), _same("pos_embed", "transformer.wpe.weight"),
        *_layer_norm_rules(("final_norm", "transformer.ln_f"),
                           ("layers/attn_norm", p + "ln_1"), ("layers/mlp_norm", p + "ln_2")),
        qkv_weight, qkv_bias,
        _t("layers/wo", p + "attn.c_proj.weight"), _same("layers/bo", p + "attn.c_proj.bias"),
        _t("layers/w_up", p + "mlp.c_fc.weight"), _same("layers/b_up", p + "mlp.c_fc.bias"),
        _t("layers/w_down", p + "mlp.c_proj.weight"),
        _same("layers/b_down", p + "mlp.c_proj.bias"),
    ]
    if not config.tie_word_embeddings:
        rules.append(_t("lm_head", "lm_head.weight"))
    return rules


def pairs_to_halves(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows [heads * D, ...] of q or k whose RoPE rotates adjacent pairs (2i, 2i + 1) of each
    head, reordered so that the pairs sit at (i, i + D/2), where this forward's RoPE rotates
    them; q and k reordered alike give the same scores."""
    dim = rows.shape[0] // heads
    return rows.reshape(heads, dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def halves_to_pairs(rows: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`pairs_to_halves`."""
    dim = rows.shape[0] // heads
    return rows.reshape(heads, 2, dim // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def cohere_rules(config: ModelConfig) -> list[Rule]:
    """Rules for CohereForCausalLM and Cohere2ForCausalLM checkpoints: Llama's names, one
    LayerNorm (a scale) per block, q's and k's rows reordered per head from RoPE on
    adjacent pairs to RoPE on halves (:func:`pairs_to_halves`)."""
    p = "model.layers.{i}."

    def pairs_rule(leaf: str, name: str, heads: int, weight: bool) -> Rule:
        if weight:  # [H*D, d] -> [d, H*D]
            return Rule(name, (leaf,), lambda a: (pairs_to_halves(a, heads).T,),
                        lambda a: halves_to_pairs(np.asarray(a).T, heads))
        return Rule(name, (leaf,), lambda a: (pairs_to_halves(a, heads),),
                    lambda a: halves_to_pairs(np.asarray(a), heads))

    heads = {"q": config.num_heads, "k": config.num_kv_heads}
    reordered = {f"layers/{kind}{x}" for kind in "wb" for x in "qk"}
    rules = [rule for rule in llama_rules(config)
             if rule.leaves[0] not in reordered and rule.leaves != ("layers/mlp_norm",)]
    rules += [pairs_rule(f"layers/w{x}", f"{p}self_attn.{x}_proj.weight", heads[x], True)
              for x in "qk"]
    if config.qkv_bias:
        rules += [pairs_rule(f"layers/b{x}", f"{p}self_attn.{x}_proj.bias", heads[x], False)
                  for x in "qk"]
    return rules


def rules_for(config: ModelConfig) -> list[Rule]:
    if config.family == "gpt_neox":
        return neox_rules(config)
    if config.family == "phi":
        return phi_rules(config)
    if config.family == "starcoder2":
        return starcoder2_rules(config)
    if config.family == "gpt_bigcode":
        return bigcode_rules(config)
    if config.family in ("cohere", "cohere2"):
        return cohere_rules(config)
    if config.family is not None:
        return family_rules(config)
    return llama_rules(config) if config.architecture == "llama" else gpt2_rules(config)


# Tensors some checkpoints carry that hold no parameters (buffers) or duplicate a tied one.
def _ignorable(name: str, config: ModelConfig) -> bool:
    if name.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")):
        return True
    if config.family == "gpt_neox" and name.endswith((".attention.bias",
                                                      ".attention.masked_bias")):
        return True  # older GPT-NeoX checkpoints (Pythia's) keep the causal mask buffers
    return config.tie_word_embeddings and name == "lm_head.weight"


# Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration): the text tower under
# these prefixes (transformers >= 4.52, then older), read as a Gemma3ForCausalLM's names.
_GEMMA3_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                         "language_model.lm_head.": "lm_head."}
# ... and the image side, which a text model does not read.
_GEMMA3_IMAGE_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.",
                          "vision_tower.", "multi_modal_projector.")


def _ignorable_family(name: str, config: ModelConfig) -> bool:
    return config.family == "gemma3_text" and name.startswith(_GEMMA3_IMAGE_PREFIXES)


def _normalise_name(name: str, config: ModelConfig) -> str:
    # GPT-2 checkpoints appear both with and without the "transformer." prefix.
    if config.architecture == "gpt2" and name.startswith("transformer."):
        return name[len("transformer."):]
    if config.family == "gpt_neox" and name == "lm_head.weight":
        return "embed_out.weight"  # the module's name; files keep the original one
    if config.family == "gemma3_text":
        for prefix, ours in _GEMMA3_TEXT_PREFIXES.items():
            if name.startswith(prefix):
                return ours + name[len(prefix):]
    return name


def _compile(rules: list[Rule]):
    compiled = []
    for rule in rules:
        pattern = "^" + re.escape(rule.hf_name).replace(re.escape("{i}"), r"(\d+)").replace(
            re.escape("{e}"), r"(\d+)") + "$"
        compiled.append((re.compile(pattern), rule))
    return compiled


def _leaf_shape(shapes: dict, leaf: str) -> tuple[int, ...]:
    node = shapes
    for part in leaf.split("/"):
        node = node[part]
    return node


def params_from_hf_tensors(config: ModelConfig, tensors: Mapping[str, np.ndarray],
                           source: str = "checkpoint", dtype=None) -> dict:
    """Builds the specjax parameter tree from HF-named tensors.

    Args:
      config: the model config the tensors must match.
      tensors: HF tensor name -> array (numpy or anything ``np.asarray`` accepts).
      source: a name for error messages (file or directory).
      dtype: cast every parameter to this dtype; ``None`` keeps the stored dtype.
    Raises:
      CheckpointError: naming the first unmapped, duplicated, missing or mis-shaped tensor.
    """
    shapes = param_shapes(config)
    compiled = _compile(rules_for(config))
    # leaf -> {layer: row} ({(layer, expert): row} for experts); nothing is sized by
    # num_layers before the tensors are seen, so a config claiming millions of layers costs
    # nothing until it is rejected.
    stacked: dict[str, dict] = {}
    flat: dict[str, np.ndarray] = {}
    seen: dict[str, str] = {}
    for raw_name, value in tensors.items():
        name = _normalise_name(raw_name, config)
        if _ignorable(name, config) or _ignorable_family(name, config):
            continue
        for pattern, rule in compiled:
            match = pattern.match(name)
            if match:
                break
        else:
            raise CheckpointError(f"{source}: unmapped tensor {raw_name!r}")
        if name in seen:
            raise CheckpointError(f"{source}: duplicated tensor {raw_name!r} (also {seen[name]!r})")
        seen[name] = raw_name
        layer = int(match.group(1)) if match.groups() else None
        expert = int(match.group(2)) if len(match.groups()) > 1 else None
        if layer is not None and layer >= config.num_layers:
            raise CheckpointError(
                f"{source}: tensor {raw_name!r} names layer {layer} but the config has "
                f"{config.num_layers} layers")
        if expert is not None and expert >= config.num_experts:
            raise CheckpointError(
                f"{source}: tensor {raw_name!r} names expert {expert} but the config has "
                f"{config.num_experts} experts")
        parts = rule.to_ours(np.asarray(value))
        for leaf, part in zip(rule.leaves, parts):
            expected = _leaf_shape(shapes, leaf)
            expected = expected[(layer is not None) + (expert is not None):]
            if tuple(part.shape) != tuple(expected):
                raise CheckpointError(
                    f"{source}: tensor {raw_name!r} has shape {tuple(np.shape(value))}, which "
                    f"does not fit {leaf} {tuple(expected)}")
            if layer is None:
                flat[leaf] = part
            else:
                stacked.setdefault(leaf, {})[layer if expert is None else (layer, expert)] = part
    leaf_rules = {leaf: rule for _, rule in compiled for leaf in rule.leaves}
    for leaf, rule in leaf_rules.items():
        if "{e}" in rule.hf_name:
            rows = stacked.get(leaf, {})
            for i in range(config.num_layers):
                for e in range(config.num_experts):
                    if (i, e) not in rows:
                        raise CheckpointError(
                            f"{source}: missing tensor {rule.hf_name.format(i=i, e=e)!r}")
            stacked[leaf] = {i: np.stack([rows[(i, e)] for e in range(config.num_experts)])
                             for i in range(config.num_layers)}
        elif "{i}" in rule.hf_name:
            rows = stacked.get(leaf, {})
            if len(rows) < config.num_layers:  # the first missing layer is <= len(rows)
                missing = min(set(range(len(rows) + 1)) - set(rows))
                raise CheckpointError(
                    f"{source}: missing tensor {rule.hf_name.format(i=missing)!r}")
        elif leaf not in flat:
            raise CheckpointError(f"{source}: missing tensor {rule.hf_name!r}")
    params: dict = {"layers": {}}
    for leaf, value in flat.items():
        params[leaf] = value
    for leaf, rows in stacked.items():
        params["layers"][leaf.split("/", 1)[1]] = np.stack([rows[i] for i in range(len(rows))])
    if dtype is not None:
        params = {k: ({kk: vv.astype(dtype) for kk, vv in v.items()} if isinstance(v, dict)
                      else v.astype(dtype)) for k, v in params.items()}
    return params


def hf_tensors_from_params(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Inverse of :func:`params_from_hf_tensors`: HF tensor name -> numpy array."""
    out: dict[str, np.ndarray] = {}

    def get(leaf):
        node = params
        for part in leaf.split("/"):
            node = node[part]
        return np.asarray(node)

    for rule in rules_for(config):
        values = [get(leaf) for leaf in rule.leaves]
        if "{e}" in rule.hf_name:
            for i in range(config.num_layers):
                for e in range(config.num_experts):
                    out[rule.hf_name.format(i=i, e=e)] = np.ascontiguousarray(
                        rule.to_hf(*[v[i][e] for v in values]))
        elif "{i}" in rule.hf_name:
            for i in range(config.num_layers):
                out[rule.hf_name.format(i=i)] = np.ascontiguousarray(rule.to_hf(*[v[i] for v in values]))
        else:
            out[rule.hf_name] = np.ascontiguousarray(rule.to_hf(*values))
    if config.architecture == "gpt2":
        out = {"transformer." + k: v for k, v in out.items()}
    return out
