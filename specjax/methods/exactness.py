"""How exact one run is: ``stats["exact"]`` and ``stats["exact_reason"]``.

Every method is exact by construction *given* that a verify pass computes each tree node's
logits as the one-token step of ``ar`` would at the same position. Whether that holds bit
for bit depends on the path the program ran, not on the method:

* ``"bitwise"``: the tokens are ``ar``'s token for token, whatever near-ties the logits
  hold. ``ar`` itself (one pass per token: ``jump_forward=0``, or unconstrained; its
  jump-forward passes over a forced run count as verify passes here); and the
  row-independent path (attention ``"fused"`` on a GPU or TPU:
  the position-ordered attention kernel and the row-tiled projections, whose arithmetic per
  row does not depend on how many rows the pass has; ``tests/test_fused_kernels.py``).
* ``"up to rounding"``: a verify pass and a one-token step may round differently in the
  last bits (XLA's and cuBLAS's dots choose their tiling, and so their order of summation,
  by the number of rows; the CPU runs one row as a matrix-vector product and several as a
  matrix product). Greedy and coupled tokens then equal ``ar``'s except where such a
  difference flips a near-tie of the two best tokens. On the 2-core CPU the suite finds the
  tokens equal on every method and family (``tests/test_families.py``); on a GPU in
  bfloat16, near-ties are common and runs do differ.
* ``"in distribution"``: the ``match`` and ``rejection`` rules at ``temperature > 0`` draw
  another sample of the same target distribution; the tokens are not ``ar``'s by design.
"""

from __future__ import annotations

from specjax.kernel_options import KernelOptions

BITWISE = "bitwise"
UP_TO_ROUNDING = "up to rounding"
IN_DISTRIBUTION = "in distribution"
LEVELS = (BITWISE, UP_TO_ROUNDING, IN_DISTRIBUTION)
# The largest pass the fused layers take (specjax.models.FUSED_MAX_TOKENS; a test keeps the
# two equal: the models sit beside this module in the core, not below it).
FUSED_MAX_TOKENS = 128


def unordered_fallbacks(fallbacks) -> list[str]:
    """The ``"site: reason"`` lines of a run's fallbacks that cost a fused run its bitwise
    guarantee: those recorded as not row-independent (attention that is not
    position-ordered, a jnp reference or an interpreted kernel in place of a row-tiled one).

    Args:
      fallbacks: the run's :class:`specjax.kernels.fallbacks.Fallback` records (each with
        ``row_independent``, set by the site that fell back).
    Returns:
      Their lines, sorted.
    """
    return sorted(str(fallback) for fallback in fallbacks if not fallback.row_independent)


def run_exactness(method: str, verify: str | None, sampled: bool, platform: str,
                  kernels: KernelOptions, verify_rows: int,
                  fallbacks=()) -> tuple[str, str]:
    """The exactness level of one run and why, one line each.

    Args:
      method: the method's name (``"ar"``, ``"spec"``, ...).
      verify: the method's verify rule (``None`` for ``ar``).
      sampled: whether the run samples (``temperature > 0``; ``None`` temperatures, a
        batch of mixed rows, count as sampled).
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``: where the program ran.
      kernels: the run's :class:`~specjax.kernel_options.KernelOptions`.
      verify_rows: the most tree nodes one verify pass holds (the method's budget; for
        ``ar`` the most tokens one pass holds: 1, or 1 + ``jump_forward`` under a
        constraint).
      fallbacks: the run's :class:`~specjax.kernels.fallbacks.Fallback` records (its
        ``stats["fallbacks"]`` are their lines): on the fused path, one that ran something
        not row-independent (:func:`unordered_fallbacks`, e.g. a cache capacity the ordered
        attention kernel does not take) makes the run "up to rounding".
    Returns:
      (level, reason): ``level`` one of :data:`LEVELS`.
    """
    if method == "ar" and verify_rows <= 1:
        return BITWISE, "ar is the reference: one target pass per token"
    if sampled and verify in ("match", "rejection"):
        return IN_DISTRIBUTION, (f"verify rule {verify!r} samples the target distribution "
                                 f"exactly, not ar's tokens")
    if kernels.attention == "fused" and platform in ("gpu", "tpu"):
        unordered = unordered_fallbacks(fallbacks)
        if unordered:
            return UP_TO_ROUNDING, (f"attention 'fused' fell back where rows are not "
                                    f"independent ({unordered[0]}); tokens equal ar's "
                                    f"unless that flips a near-tie")
        if verify_rows <= FUSED_MAX_TOKENS:
            return BITWISE, ("attention 'fused': row-independent kernels, so a verify pass "
                             "reproduces ar's one-token steps bit for bit")
        return UP_TO_ROUNDING, (f"attention 'fused' takes passes of at most "
                                f"{FUSED_MAX_TOKENS} tokens; this method verifies "
                                f"{verify_rows} at once on the default layers")
    if kernels.attention == "fused":
        why = ("attention 'fused' on the CPU runs its kernels in Pallas' interpreter, as XLA "
               "CPU programs whose optimiser may reorder their sums")
    elif platform == "cpu":
        why = ("on the CPU a pass of several tokens (a verify pass, or ar's over a forced "
               "run) runs as a matrix product and ar's one-token step as a matrix-vector "
               "product, which may round differently")
    else:
        why = (f"attention {kernels.attention!r} on {platform}: the dots choose their tiling "
               f"by row count, so a verify pass and ar's step may round differently "
               f"(attention 'fused' is bitwise)")
    return UP_TO_ROUNDING, why + "; tokens equal ar's unless that flips a near-tie"
