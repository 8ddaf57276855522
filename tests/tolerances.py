"""How far apart two floating-point computations of the same quantity may land.

Two evaluations that differ only in the order of their sums (a cached pass against an
uncached one, a kernel against its reference, XLA's vector width on one CPU against
another's) each round differently. Under the usual probabilistic model of rounding
(Higham & Mary, "A New Approach to Probabilistic Rounding Error Analysis", 2019), a sum
of ``n`` terms of size at most ``m`` carries an error of about ``u * sqrt(n) * m``, ``u``
being the unit roundoff of the dtype (2**-24 for float32). A network chains such sums:
each stage (a projection, an attention reduction, a norm, the head) adds its own and
passes the earlier ones on.

:func:`sum_tolerance` turns that into an absolute tolerance:
``SAFETY * u * sqrt(longest_sum) * stages * magnitude``, where

* ``longest_sum``: the longest accumulation in the computation (the widest contraction
  or the longest softmax row);
* ``stages``: how many reordered sums are chained between input and output;
* ``magnitude``: the size of the values compared (their max-abs, taken from the
  expected array by :func:`assert_sums_close`).

``SAFETY`` covers the tails of the error distribution and the growth of an error through
the layers after it: a model with random weights at our test scales amplifies by a
small constant. Tests state their three numbers, so a reader sees what the tolerance
rests on, and a machine whose rounding differs (another instruction set, another BLAS)
still passes while a real bug (a wrong mask, a missing term: errors of order
``magnitude``) still fails.
"""

from __future__ import annotations

import math

import numpy as np

SAFETY = 4.0


def unit_roundoff(dtype) -> float:
    """Half the machine epsilon of ``dtype`` (float32: 2**-24)."""
    return float(np.finfo(np.dtype(dtype)).eps) / 2


def sum_tolerance(*, longest_sum: int, stages: int, magnitude: float,
                  dtype=np.float32) -> float:
    """Absolute tolerance for comparing two orderings of the same chained sums (see the
    module docstring)."""
    if longest_sum < 1 or stages < 1 or magnitude < 0:
        raise ValueError("longest_sum and stages must be >= 1, magnitude >= 0")
    return SAFETY * unit_roundoff(dtype) * math.sqrt(longest_sum) * stages * magnitude


def assert_sums_close(got, want, *, longest_sum: int, stages: int, dtype=np.float32,
                      err_msg: str = "") -> None:
    """``got`` equals ``want`` within :func:`sum_tolerance`, the magnitude being
    ``want``'s largest absolute value (at least 1, so that arrays of tiny values are
    held to the scale their sums ran at)."""
    want = np.asarray(want, np.float64)
    magnitude = max(float(np.max(np.abs(want))) if want.size else 0.0, 1.0)
    tolerance = sum_tolerance(longest_sum=longest_sum, stages=stages, magnitude=magnitude,
                              dtype=dtype)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tolerance,
                               err_msg=err_msg or f"tolerance {tolerance:.3g} (longest sum "
                               f"{longest_sum}, {stages} stages, magnitude {magnitude:.3g})")


# Sums per decoder layer of a forward pass: the attention norm, the q/k/v projections, the
# attention scores, the weighted values, the output projection, the MLP norm, gate/up and
# down. The final norm and the head add two more.
SUMS_PER_LAYER = 8


def forward_sums(config, sequence: int) -> dict:
    """``longest_sum`` and ``stages`` of a forward pass of ``config`` over ``sequence``
    positions (keywords for :func:`assert_sums_close`)."""
    widths = [config.hidden_size, config.intermediate_size, sequence,
              config.num_heads * config.head_dim]
    return {"longest_sum": max(widths), "stages": SUMS_PER_LAYER * config.num_layers + 2}
