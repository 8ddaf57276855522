"""Pallas attention kernels (installed as ``specjax.kernels``).

The verify/decode attention kernels for GPU (Triton / Mosaic GPU) and TPU (Mosaic) are
not written yet; until they are, :func:`verify_attention` serves ``impl="auto"`` with the
pure-jnp reference and refuses ``impl="kernel"`` with a clear error.
"""

from __future__ import annotations

from specjax.errors import InvalidArgumentError


def verify_attention(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None, *,
                     fallback=None):
    """Tree/decode attention; see :func:`specjax.attention.attention` for semantics."""
    if fallback is not None:
        return fallback(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask)
    raise InvalidArgumentError(
        "attention implementation 'kernel' is not available in this build; use 'auto' or 'reference'")
