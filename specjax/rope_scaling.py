"""RoPE scaling: :class:`RopeScaling` (a field of :class:`~specjax.config.ModelConfig`) and
its Hugging Face form, read from a config (:func:`rope_from_hf`: ``rope_theta`` and
``rope_scaling``, or transformers 5's ``rope_parameters``) and written back
(:func:`rope_scaling_to_hf`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from specjax.errors import InvalidArgumentError

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
    ``factor``, ``mscale`` and ``mscale_all_dim``; :func:`rope_from_hf` does so).
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


def rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(RoPE base, scaling or ``None``) of a Hugging Face config."""
    # transformers >= 5 folds theta and scaling into ``rope_parameters``; older configs use
    # ``rope_theta`` + ``rope_scaling``.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta")
    theta = float(params.get("rope_theta", 10000.0) if theta is None else theta)
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
    original = cfg.get("original_max_position_embeddings")
    original = int(merged.get("original_max_position_embeddings", max_positions)
                   if original is None else original)
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
                attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                             if mscale and mscale_all_dim else yarn_mscale(factor))
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(factor) + 1`` (1 for
    ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scaling_to_hf(scaling: RopeScaling) -> dict[str, Any]:
    """``scaling`` as a Hugging Face config's ``rope_scaling`` (what :func:`rope_from_hf`
    reads)."""
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
