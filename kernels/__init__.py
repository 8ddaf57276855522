"""Pallas attention kernels for decode and tree verification (installed as ``specjax.kernels``).

:func:`verify_attention` is what :func:`specjax.attention.attention` calls for
``impl="kernel"`` and ``impl="auto"``; it computes exactly
:func:`specjax.attention.attention_reference` with one of two kernels:

* :func:`verify_attention_gpu` in :mod:`.attention_gpu` (Pallas, Triton lowering;
  :class:`GpuBlockSizes`);
* :func:`verify_attention_tpu` in :mod:`.attention_tpu` (Pallas, Mosaic lowering;
  :class:`TpuBlockSizes`).

Each is a jitted wrapper with static ``block_sizes`` and ``interpret`` arguments, and each
module has ``check_supported`` (the one-line :class:`~specjax.errors.InvalidArgumentError`
checks, shapes and dtypes only).

Both split the committed cache over the KV length with an online softmax
(flash-decoding), skip blocks past the traced ``length``, put a KV head's query heads and
all tree nodes in one query tile (GQA), and merge the scratch window plus the tree block
under its mask in a final combine kernel (:mod:`specjax.kernels.layout`).

Which kernel runs (``variant=None``):

* ``jax.default_backend()`` is ``gpu`` -> the GPU kernel, ``tpu`` -> the TPU kernel;
* anywhere else (CPU): with a ``fallback`` (``impl="auto"``) the fallback runs; without one
  (``impl="kernel"``) the kernel runs in *interpret mode*: the GPU kernel under Pallas'
  generic interpreter, or the TPU kernel under the TPU interpreter with
  ``interpret_variant="tpu"`` (default ``gpu``; ``KernelOptions.interpret_variant``, which
  the model functions pass down). Interpret mode is exact but slow: it is for tests, not
  for speed.

:func:`ordered_attention` sums each query's keys in an order fixed by absolute position,
so that a tree node reproduces the one-token step bit for bit; ``attention="fused"`` uses
it for every call without a scratch window. :func:`fused_linear` is the row-tiled
projection kernel (RMSNorm, bias, SwiGLU and residual folded into one matmul launch) that
``attention="fused"`` uses for every projection of the Llama family. Each has a GPU and a
TPU kernel, chosen like :func:`verify_attention`'s (natively on that backend, interpreted
elsewhere; ``interpret_variant="tpu"`` picks the TPU ones):

* :func:`ordered_attention_gpu` in :mod:`.attention_ordered_gpu` (Triton;
  :class:`GpuOrderedBlockSizes`), :func:`ordered_attention_tpu` in
  :mod:`.attention_ordered_tpu` (Mosaic; :class:`TpuOrderedBlockSizes`);
* :func:`ordered_attention_packed` (GPU only: :func:`ordered_attention_packed_gpu`) is the
  same attention reading a layer loop's packed q|k|v rows and writing the output
  projection's row-major input, which spares a fused layer three launches on a GPU;
  :func:`qkv_rope_into` writes those rows (GPU, Triton: :func:`qkv_rope_into_gpu`, the
  q|k|v projection with RoPE and the in-place write in its epilogue, one launch more
  spared);
* :func:`fused_linear_gpu` in :mod:`.linear_gpu` (Triton; :class:`GpuLinearBlockSizes`),
  :func:`fused_linear_tpu` in :mod:`.linear_tpu` (Mosaic; :class:`TpuLinearBlockSizes`);
* :func:`norm_groups` (the fused layers' q/k norms, per head or over all heads, in
  place on the q|k|v rows; output norms; LayerNorm and Gemma's ``1 + w`` RMSNorm):
  :func:`norm_groups_gpu` in :mod:`.norm_gpu` (Triton;
  :class:`GpuNormBlockSizes`), a Triton kernel only, which Pallas' interpreter runs off a
  GPU (on a TPU too, recorded below).

The GPU linear kernel has a second backend, :func:`fused_linear_mosaic_gpu` in
:mod:`.linear_mosaic_gpu` (Mosaic GPU: TMA copies and Hopper ``wgmma``, bfloat16/float16
only). It is opt-in while it has not been timed on a GPU: with ``gpu_linear="mosaic"``
(``KernelOptions(gpu_linear="mosaic")``, passed down by the model functions),
:func:`fused_linear` gives it every call it takes and the Triton kernel the rest (float32,
a transposed head, widths that are not multiples of 64); the default,
``triton``, never uses it. Off a GPU it runs under JAX's Mosaic GPU interpreter.

With a ``fallback``, shapes the chosen kernel does not take (more than 128 new tokens, an
unsupported head_dim or dtype, ...) go to the fallback; without one they raise
:class:`specjax.errors.InvalidArgumentError`.

Fallbacks are never silent: each site below calls :func:`.fallbacks.record` with a
one-line reason while the program is traced, and a run lists them in
``stats["fallbacks"]`` (see :mod:`.fallbacks`):

* :func:`verify_attention` with a fallback (``impl="auto"``): no kernel runs natively on
  this backend (a CPU's ``"auto"`` runs jnp attention before reaching it, by design, and
  records nothing), the kernel refuses the shapes, or the call has soft-capping or a
  sliding window and the kernel takes neither (:func:`takes_windows`; the GPU and TPU
  kernels take both): the jnp attention runs;
* :func:`fused_linear` with ``fallback``: the kernel refuses the projection (a width that
  is not a multiple of 16, blocks over a TPU's VMEM budget): its jnp reference runs; with
  ``SPECJAX_GPU_KERNELS=mosaic``, a call the Mosaic GPU kernel refuses goes to Triton;
* :func:`qkv_rope_into`: the Triton kernel refuses the call: :func:`fused_linear` and
  :func:`.numerics.write_rope_rows` run;
* :func:`ordered_attention`: the kernel refuses the shapes (a cache capacity that is not a
  multiple of its block): :func:`verify_attention`'s kernel runs, which is not
  position-ordered (drafting calls with a scratch window take that kernel by design, and
  are not recorded: a draft's numbers never decide a token);
* :func:`packed_attention_takes`: the packed GPU kernel refuses the shapes: the fused
  layers run :func:`ordered_attention` unpacked;
* :func:`norm_groups`: the kernel refuses the shapes (a group width that is not a
  multiple of 16): its jnp reference runs; on a TPU, Pallas' interpreter runs the kernel.

The models layer records its own: ``attn_impl="fused"`` over a pass of more than
:data:`specjax.models.FUSED_MAX_TOKENS` tokens, or for a family without fused layers.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from specjax.errors import InvalidArgumentError
from . import fallbacks
from .numerics import write_rope_rows

__all__ = ["GpuBlockSizes", "GpuLinearBlockSizes", "GpuNormBlockSizes",
           "GpuOrderedBlockSizes",
           "MosaicGpuLinearBlockSizes", "TpuBlockSizes", "TpuLinearBlockSizes",
           "TpuOrderedBlockSizes", "fused_linear", "fused_linear_gpu",
           "fused_linear_mosaic_gpu", "fused_linear_tpu", "ordered_attention",
           "ordered_attention_gpu", "ordered_attention_packed", "ordered_attention_tpu",
           "packed_attention_takes", "qkv_rope_into", "qkv_rope_into_gpu", "norm_groups",
           "norm_groups_gpu", "takes_windows",
           "verify_attention",
           "verify_attention_gpu", "verify_attention_tpu", "gpu_kernel_backend",
           "linear_row_tile", "select_variant"]

GPU_KERNEL_BACKENDS = ("triton", "mosaic")
VARIANTS = ("gpu", "tpu")
_MODULES = {"gpu": "attention_gpu", "tpu": "attention_tpu"}
_LINEAR_MODULES = {"gpu": "linear_gpu", "tpu": "linear_tpu"}
_ORDERED_MODULES = {"gpu": "attention_ordered_gpu", "tpu": "attention_ordered_tpu"}
# The kernel modules import Pallas; they load on first use. Keep this package cheap and
# safe to import: run from the repository root, this directory is also importable as a
# top-level ``kernels``, and transformers imports that name when it probes for HF kernels.
_LAZY = {"GpuBlockSizes": "attention_gpu", "verify_attention_gpu": "attention_gpu",
         "TpuBlockSizes": "attention_tpu", "verify_attention_tpu": "attention_tpu",
         "GpuLinearBlockSizes": "linear_gpu", "fused_linear_gpu": "linear_gpu",
         "qkv_rope_into_gpu": "linear_gpu",
         "GpuOrderedBlockSizes": "attention_ordered_gpu",
         "ordered_attention_gpu": "attention_ordered_gpu",
         "ordered_attention_packed_gpu": "attention_ordered_gpu",
         "packed_links": "attention_ordered_gpu",
         "TpuLinearBlockSizes": "linear_tpu", "fused_linear_tpu": "linear_tpu",
         "TpuOrderedBlockSizes": "attention_ordered_tpu",
         "ordered_attention_tpu": "attention_ordered_tpu",
         "GpuNormBlockSizes": "norm_gpu", "norm_groups_gpu": "norm_gpu",
         "MosaicGpuLinearBlockSizes": "linear_mosaic_gpu",
         "fused_linear_mosaic_gpu": "linear_mosaic_gpu"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kernel_module(variant: str, modules: dict = _MODULES):
    return importlib.import_module(f"{__name__}.{modules[variant]}")


def select_variant(variant: str | None = None, interpret_variant: str = "gpu"
                   ) -> tuple[str, bool]:
    """(kernel variant, interpret) for this process: see the module docstring.

    Args:
      variant: ``"gpu"``, ``"tpu"`` or ``None`` (choose from the default backend).
      interpret_variant: the variant ``None`` chooses off GPU/TPU, interpreted
        (``KernelOptions.interpret_variant``).
    """
    backend = jax.default_backend()
    native = "gpu" if backend in ("gpu", "cuda", "rocm") else "tpu" if backend == "tpu" else None
    if variant is None:
        variant = native or interpret_variant
    if variant not in VARIANTS:
        raise InvalidArgumentError(
            f"unknown kernel variant {variant!r} (from interpret_variant or variant=); "
            f"expected one of {VARIANTS}")
    return variant, variant != native


def gpu_kernel_backend(gpu_linear: str = "triton") -> str:
    """``gpu_linear`` checked: the GPU linear kernel's backend, ``"triton"`` (the default)
    or ``"mosaic"`` (``KernelOptions.gpu_linear``); see the module docstring."""
    if gpu_linear not in GPU_KERNEL_BACKENDS:
        raise InvalidArgumentError(
            f"gpu_linear={gpu_linear!r} is not a GPU kernel backend; expected one of "
            f"{GPU_KERNEL_BACKENDS}")
    return gpu_linear


def linear_row_tile(dtype, variant: str | None = None, *, interpret_variant: str = "gpu",
                    gpu_linear: str = "triton") -> int:
    """The rows :func:`fused_linear` pads a call to (its kernel's row tile) for this
    process's variant and GPU backend: 64 for the Mosaic GPU kernel's 16-bit calls (one
    ``wgmma`` M), else 16 (Triton's and the TPU kernel's default ``block_rows``). A caller
    that keeps its rows at a multiple of it is never padded per call.
    """
    variant, _ = select_variant(variant, interpret_variant)
    if variant == "gpu" and gpu_kernel_backend(gpu_linear) == "mosaic":
        mosaic = importlib.import_module(f"{__name__}.linear_mosaic_gpu")
        if jnp.dtype(dtype) in mosaic.DTYPES:
            return mosaic.ROWS
    module = _kernel_module(variant, _LINEAR_MODULES)
    sizes = module.GpuLinearBlockSizes if variant == "gpu" else module.TpuLinearBlockSizes
    return sizes().block_rows


def takes_windows(variant: str) -> bool:
    """Whether ``variant``'s verify-attention kernel takes soft-capping and sliding windows
    (its module says so with ``TAKES_WINDOWS = True``)."""
    return getattr(_kernel_module(variant), "TAKES_WINDOWS", False)


def verify_attention(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None, *,
                     fallback=None, variant: str | None = None, block_sizes=None, layer=None,
                     softcap: float | None = None, first_visible=None,
                     interpret_variant: str = "gpu"):
    """Tree/decode attention by a Pallas kernel; see :func:`specjax.attention.attention`.

    Args:
      q: [T, H, D] queries; k_new, v_new: [T, K, D]; k_cache, v_cache: [S, K, D],
      [L, S, K, D] (with ``layer``) or ``None``; length: int32 [] committed slots;
      mask: bool [T, T]; scratch_mask: bool [T, M] or ``None``.
      fallback: an implementation with the same positional signature, used where no
        kernel runs natively or the kernel does not take the shapes (``impl="auto"``);
        ``None`` (``impl="kernel"``) forces the kernel, interpreted off GPU/TPU.
      variant: ``"gpu"`` or ``"tpu"`` to pick a kernel explicitly (interpreted unless it
        matches the backend); ``None`` chooses as the module docstring says.
      block_sizes: optional :class:`GpuBlockSizes` / :class:`TpuBlockSizes` for the variant.
      layer: int32 [] layer of [L, S, K, D] caches. A kernel module that reads the layer in
        place says so with ``TAKES_LAYER_INDEX = True``; for the others the layer is
        sliced out here (a copy of [S, K, D] per call).
      softcap, first_visible: soft-capping and a sliding window, as in
        :func:`specjax.attention.attention`; a kernel without them (:func:`takes_windows`)
        leaves the call to the fallback, or refuses it without one.
    Returns:
      [T, H, D] in the dtype of ``q``.
    Raises:
      InvalidArgumentError: without a fallback, shapes/dtypes the kernel cannot take.
    """
    args = (q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask)
    extras = {name: value for name, value in (("softcap", softcap),
                                              ("first_visible", first_visible))
              if value is not None}

    def run_fallback(why: str):
        fallbacks.record("verify_attention", f"{why}; attention='auto' ran the jnp attention",
                         row_independent=False)
        return fallback(*args, **extras) if layer is None else fallback(*args, layer=layer,
                                                                        **extras)

    variant, interpret = select_variant(variant, interpret_variant)
    if fallback is not None and interpret:
        # "auto" never interprets: the reference is faster.
        return run_fallback(f"no Pallas kernel runs natively on the {jax.default_backend()} "
                            f"backend")
    module = _kernel_module(variant)
    if extras and not takes_windows(variant):
        why = f"the {module.KERNEL_NAME} takes no soft-capping or sliding windows"
        if fallback is not None:
            return run_fallback(why)
        raise InvalidArgumentError(f"attention 'kernel': {why} (use attention 'auto')")
    options = {} if block_sizes is None else {"block_sizes": block_sizes}
    if layer is not None and k_cache is not None:
        if getattr(module, "TAKES_LAYER_INDEX", False):
            options["layer"] = layer
        else:
            k_cache, v_cache = (jax.lax.dynamic_index_in_dim(c, layer, keepdims=False)
                                for c in (k_cache, v_cache))
            args = (q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask)
            layer = None
    if fallback is not None:
        try:
            module.check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                                   **{k: v for k, v in options.items() if k != "layer"},
                                   **extras)
        except InvalidArgumentError as error:
            # The refusal's advice ("use attention 'auto' ...") is what ran: leave it out.
            return run_fallback(str(error).split(" (use attention ")[0])
    return getattr(module, f"verify_attention_{variant}")(*args, interpret=interpret,
                                                          **options, **extras)


def fused_linear(x, weights, *, variant: str | None = None, block_sizes=None,
                 fallback: bool = False, interpret_variant: str = "gpu",
                 gpu_linear: str = "triton", **kwargs):
    """``residual + act(rms_norm(x) @ W + b)`` by the row-tiled Pallas kernel; see
    :func:`specjax.kernels.linear_gpu.fused_linear_gpu` for the arguments (the TPU kernel,
    :func:`~.linear_tpu.fused_linear_tpu`, takes the same).

    The kernel is chosen like :func:`verify_attention`'s: natively on a GPU or TPU,
    interpreted elsewhere (tests). With ``fallback``, shapes the kernel does not take (on
    a GPU a width that is not a multiple of 16, such as a 50257-token vocabulary; on a TPU
    blocks over its VMEM budget) run :func:`~.linear_gpu.fused_linear_reference`.

    On the GPU variant with ``gpu_linear="mosaic"``, a call the Mosaic GPU kernel
    takes (:func:`.linear_mosaic_gpu.check_supported`) runs it; the others go on as above.
    The choice reads shapes and dtypes only, never the row count, so a verify pass and the
    one-token step take the same kernel for the same projection.

    Args:
      variant: ``"gpu"``, ``"tpu"`` or ``None`` (see :func:`select_variant`).
      interpret_variant: see :func:`select_variant`.
      gpu_linear: ``"triton"`` or ``"mosaic"``: the GPU variant's backend.
      block_sizes: optional :class:`GpuLinearBlockSizes` / :class:`TpuLinearBlockSizes`
        (or :class:`MosaicGpuLinearBlockSizes` for the Mosaic GPU kernel).
    Raises:
      InvalidArgumentError: without ``fallback``, shapes the kernel does not take.
    """
    variant, interpret = select_variant(variant, interpret_variant)
    if (variant == "gpu" and gpu_kernel_backend(gpu_linear) == "mosaic"
            and kwargs.get("activation") is not None):
        # its epilogue is SwiGLU's; the (shape-only) choice is the same at any row count
        fallbacks.record("fused_linear", f"the Mosaic GPU kernel takes no "
                         f"{kwargs['activation']} activation; the call goes to the Triton "
                         f"kernel", row_independent=True)
    elif variant == "gpu" and gpu_kernel_backend(gpu_linear) == "mosaic":
        mosaic = importlib.import_module(f"{__name__}.linear_mosaic_gpu")
        mosaic_sizes = block_sizes if isinstance(block_sizes,
                                                 mosaic.MosaicGpuLinearBlockSizes) else None
        options = {} if mosaic_sizes is None else {"block_sizes": mosaic_sizes}
        try:
            mosaic.check_supported(
                x, weights, stacked=kwargs.get("layer") is not None, **options,
                **{k: kwargs[k] for k in ("offsets", "width", "transposed") if k in kwargs})
        except InvalidArgumentError as error:
            # the Triton kernel (or, with fallback, the reference) takes it
            fallbacks.record("fused_linear", f"{error}; the call goes to the Triton kernel",
                             row_independent=True)
        else:
            return mosaic.fused_linear_mosaic_gpu(x, tuple(weights), interpret=interpret,
                                                  **options, **kwargs)
        if mosaic_sizes is not None:
            block_sizes = None
    module = _kernel_module(variant, _LINEAR_MODULES)
    options = {} if block_sizes is None else {"block_sizes": block_sizes}
    if fallback:
        shape = {k: kwargs[k] for k in ("offsets", "width", "transposed") if k in kwargs}
        if variant == "tpu":  # its VMEM estimate counts the optional blocks
            shape.update(has_norm=kwargs.get("norm") is not None,
                         has_residual=kwargs.get("residual") is not None,
                         float32_out=kwargs.get("float32_out", False))
        try:
            module.check_supported(x, weights, stacked=kwargs.get("layer") is not None,
                                   **shape, **options)
        except InvalidArgumentError as error:
            fallbacks.record("fused_linear", f"{error}; its jnp reference ran",
                             row_independent=False)
            return module.fused_linear_reference(x, tuple(weights), **kwargs)
    return getattr(module, f"fused_linear_{variant}")(x, tuple(weights), interpret=interpret,
                                                      **options, **kwargs)


def qkv_rope_into(packed, x, weight, cos, sin, layer, *, norm=None, bias=None,
                  rope_heads: int, eps: float = 1e-6, variant: str | None = None,
                  interpret_variant: str = "gpu", gpu_linear: str = "triton"):
    """Layer ``layer`` of a packed q|k|v buffer [L, R, heads, D] := the heads of
    ``rms_norm(x) @ W + b``, RoPE on the first ``rope_heads``; arguments as
    :func:`.linear_gpu.qkv_rope_into_gpu`.

    On the GPU variant with the Triton backend (native, or interpreted off a GPU), shapes
    :func:`.linear_gpu.check_rope_into` accepts run that kernel: one launch, written in
    place. Otherwise :func:`fused_linear` (with its fallback) projects and
    :func:`.numerics.write_rope_rows` rotates and writes. The choice reads
    shapes and dtypes only, so a verify pass and the one-token step take the same path.
    """
    variant, interpret = select_variant(variant, interpret_variant)
    if variant == "gpu" and gpu_kernel_backend(gpu_linear) == "triton":
        module = _kernel_module("gpu", _LINEAR_MODULES)
        try:
            module.check_rope_into(packed, x, weight, cos, sin, norm=norm, bias=bias,
                                   rope_heads=rope_heads)
        except InvalidArgumentError as error:
            # fused_linear is row-tiled too (recording its own fallback, if any); the
            # rotation is elementwise
            fallbacks.record("qkv_rope_into", f"{error}; fused_linear and write_rope_rows ran",
                             row_independent=True)
        else:
            return module.qkv_rope_into_gpu(packed, x, weight, cos, sin, layer, norm=norm,
                                            bias=bias, rope_heads=rope_heads, eps=eps,
                                            interpret=interpret)
    qkv = fused_linear(x, (weight,), norm=norm, biases=(bias,), layer=layer, eps=eps,
                       variant=variant, fallback=True, gpu_linear=gpu_linear)
    return write_rope_rows(packed, qkv, layer, cos, sin, rope_heads)


def ordered_attention(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None, *,
                      variant: str | None = None, layer=None, interpret_variant: str = "gpu",
                      scale: float | None = None, softcap: float | None = None,
                      first_visible=None):
    """Position-ordered attention (:mod:`.attention_ordered_gpu`,
    :mod:`.attention_ordered_tpu`, chosen like :func:`verify_attention`'s kernel); a call it
    does not take (a drafting call with a scratch window, a capacity that is not a multiple
    of its block) runs :func:`verify_attention` with that variant's kernel forced. Same
    arguments as that function, and ``scale``: the static score scale (``None``:
    ``D ** -0.5``), which the ordered kernels apply to each score; for
    :func:`verify_attention`'s kernel the queries are scaled by ``scale * D ** 0.5`` first;
    ``softcap`` and ``first_visible`` (a sliding window) as :func:`verify_attention` takes
    them, with ``mask`` the chains' mask without the window (both kernels mask by
    position).
    """
    extras = {name: value for name, value in (("softcap", softcap),
                                              ("first_visible", first_visible))
              if value is not None}
    variant, interpret = select_variant(variant, interpret_variant)
    module = _kernel_module(variant, _ORDERED_MODULES)
    args = (q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask)

    def unordered():
        nonlocal args
        if first_visible is not None:  # the window among the new tokens, by position
            depth = jnp.sum(mask, axis=1, dtype=jnp.int32) - 1
            near = (length + depth)[None, :] >= jnp.asarray(first_visible)[:, None]
            args = (*args[:6], mask & near, scratch_mask)
        if scale is None:
            return verify_attention(*args, variant=variant, layer=layer, **extras)
        scaled = (q.astype(jnp.float32) * (scale * q.shape[-1] ** 0.5)).astype(q.dtype)
        return verify_attention(scaled, *args[1:], variant=variant, layer=layer, **extras)

    if scratch_mask is not None and scratch_mask.shape[1] > 0:
        return unordered()  # a drafting call
    try:
        module.check_supported(*args[:5], mask, scratch_mask, **extras)
    except InvalidArgumentError as error:
        fallbacks.record("ordered_attention", f"{error}; verify_attention's kernel ran (not "
                         f"position-ordered: a verify pass may differ from the one-token "
                         f"step in the last bits)", row_independent=False)
        return unordered()
    return getattr(module, f"ordered_attention_{variant}")(*args, layer=layer,
                                                           interpret=interpret, scale=scale,
                                                           **extras)


def packed_attention_takes(packed_shape, dtype, k_cache, v_cache, *, num_heads: int,
                           variant: str | None = None, interpret_variant: str = "gpu") -> bool:
    """Whether :func:`ordered_attention_packed` runs for packed rows of ``packed_shape``
    [L, R, H + 2K, D] and ``dtype`` with these caches: the GPU variant (native, or
    interpreted off a GPU) and shapes its kernel takes. The TPU variant has no packed
    kernel: its fused layers call :func:`ordered_attention`."""
    variant, _ = select_variant(variant, interpret_variant)
    if variant != "gpu":
        return False
    module = _kernel_module("gpu", _ORDERED_MODULES)
    try:
        module.check_packed(jax.ShapeDtypeStruct(packed_shape, dtype), k_cache, v_cache,
                            num_heads=num_heads)
    except InvalidArgumentError as error:
        # The unpacked kernel orders the sums the same way (recording its own refusal)
        fallbacks.record("ordered_attention_packed", f"{error}; the fused layers run "
                         f"ordered_attention unpacked", row_independent=True)
        return False
    return True


def ordered_attention_packed(packed, layer, k_cache, v_cache, length, links, depth, *,
                             num_heads: int, variant: str | None = None,
                             interpret_variant: str = "gpu", scale: float | None = None,
                             softcap: float | None = None, first_visible=None):
    """:func:`ordered_attention_packed_gpu` (see there), natively on a GPU and interpreted
    elsewhere; only where :func:`packed_attention_takes` says so. ``scale``: the static
    score scale (``None``: ``D ** -0.5``); ``softcap`` and ``first_visible`` [rows] (a
    sliding window) as :func:`ordered_attention` takes them."""
    variant, interpret = select_variant(variant, interpret_variant)
    if variant != "gpu":
        raise InvalidArgumentError(
            f"packed ordered attention has a GPU kernel only, not {variant!r} (the TPU's "
            f"fused layers call ordered_attention)")
    module = _kernel_module(variant, _ORDERED_MODULES)
    return module.ordered_attention_packed_gpu(packed, layer, k_cache, v_cache, length, links,
                                               depth, num_heads=num_heads,
                                               interpret=interpret, scale=scale,
                                               softcap=softcap, first_visible=first_visible)


def norm_groups(x, weight, layer, *, start: int, groups: int, eps: float, kind: str = "rms",
                bias=None, variant: str | None = None, interpret_variant: str = "gpu"):
    """``x`` [R, N] with ``groups`` column groups of width W (``weight`` [L, W]) from column
    ``start`` normed by ``weight[layer]`` in place (``kind``: ``"rms"``,
    ``"rms_plus_one"`` or ``"layer"``, with LayerNorm's optional ``bias`` [L, W]): the fused
    layers' q/k norms, output norms and input norms other than Llama's, by the row-tiled
    kernel :func:`.norm_gpu.norm_groups_gpu`, whose sums do not depend on the number of
    rows. Rows are padded to its 16-row tile here when they are not already.

    It is a Triton kernel: natively on a GPU, in Pallas' generic interpreter elsewhere.
    On the TPU variant that interpreter runs it on the TPU too (recorded; slow, its sums
    still over one fixed block shape per program; not yet checked on a TPU). A call the
    kernel refuses (a group width that is not a multiple of 16) runs its jnp reference,
    recorded (not row-independent on a GPU).
    """
    variant, interpret = select_variant(variant, interpret_variant)
    module = importlib.import_module(f"{__name__}.norm_gpu")
    num_rows = x.shape[0]
    tile = module.GpuNormBlockSizes().block_rows
    if num_rows % tile:
        x = jax.numpy.pad(x, ((0, -num_rows % tile), (0, 0)))
    options = dict(start=start, groups=groups, eps=eps, kind=kind, bias=bias)
    try:
        module.check_supported(x, weight, start=start, groups=groups, kind=kind, bias=bias)
    except InvalidArgumentError as error:
        fallbacks.record("norm_groups", f"{error}; its jnp reference ran (its sums may "
                         f"be tiled by the row count)", row_independent=False)
        return module.norm_groups_reference(x, weight, layer, **options)[:num_rows]
    if variant != "gpu" and not interpret:
        # Interpreted, the kernel is XLA ops that XLA may order anew in each program
        fallbacks.record("norm_groups", f"the group norm kernel has no {variant} "
                         f"lowering; Pallas' interpreter ran it", row_independent=False)
    return module.norm_groups_gpu(x, weight, layer, interpret=interpret or variant != "gpu",
                                  **options)[:num_rows]
