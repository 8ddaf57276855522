"""Kernel options: how a program is built for the device, one typed object.

:class:`KernelOptions` is the single place for the settings that pick kernels and compile
programs: the attention implementation (which, at ``"fused"``, also runs the Llama
family's projections and head through the row-tiled kernels), the GPU linear kernel's
backend, the kernel variant interpreted off GPU/TPU, whether sampling rules are compiled
apart, and XLA compiler options. It is frozen and hashable: a
:class:`~specjax.state.DecodeLoop` holds it, so it is part of every compiled program's
cache key. None of its settings changes a token (the exactness tests run every
attention implementation); they change what runs and how fast.

>>> KernelOptions.default("gpu")                    # one default per backend
>>> KernelOptions(attention="fused", gpu_linear="mosaic")
>>> KernelOptions(compiler_options={"xla_backend_optimization_level": 0})

:func:`specjax.generate` takes it as ``kernels=``; ``specjax generate`` and
``specjax bench`` build it from the same flags (:func:`add_kernel_arguments`,
:meth:`KernelOptions.from_args`). How a list of prompts is cut into compiled batches is
:class:`specjax.batch_options.BatchOptions`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from specjax.errors import InvalidArgumentError
from specjax.sampling import static_rules

ATTENTION_IMPLEMENTATIONS = ("auto", "reference", "kernel", "fused")
GPU_LINEAR_BACKENDS = ("triton", "mosaic")
INTERPRET_VARIANTS = ("gpu", "tpu")
SAMPLING_RULES = ("auto", "static", "traced")
PLATFORMS = ("cpu", "gpu", "tpu")

_HELP = {
    "attention": "attention implementation: auto (the Pallas kernel on GPU/TPU where it "
                 "takes the shapes, jnp attention otherwise and on CPU), reference (jnp), "
                 "kernel (the Pallas kernel, interpreted on CPU), fused (Llama family, "
                 "GPU/TPU: the position-ordered attention kernel and the row-tiled kernels "
                 "for every projection and the head)",
    "gpu_linear": "GPU backend of the row-tiled linear kernel (attention fused): triton, or "
                  "mosaic (Mosaic GPU, Hopper, bfloat16/float16 calls; untimed)",
    "interpret_variant": "off GPU/TPU, which kernels run in the Pallas interpreter (tests)",
    "sampling_rules": "compile each sampling rule apart (static) or every rule with a "
                      "device-side choice (traced); auto: static on a GPU only",
    "compiler_options": "an XLA compiler option for the generation programs, NAME=VALUE "
                        "(repeatable; e.g. xla_backend_optimization_level=0)",
}


def _choice(field: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidArgumentError(f"KernelOptions.{field} must be one of "
                                   f"{', '.join(choices)}, got {value!r}")
    return value


def _compiler_options(value) -> tuple[tuple[str, Any], ...]:
    """A mapping (or pairs) of XLA option names to scalars, as a sorted tuple of pairs."""
    try:
        pairs = dict(value.items() if isinstance(value, Mapping) else value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"KernelOptions.compiler_options must be a mapping of "
                                   f"option names to values, got {value!r}") from None
    for name, item in pairs.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"KernelOptions.compiler_options: an option name must "
                                       f"be a non-empty string, got {name!r}")
        if not isinstance(item, (str, int, float, bool)):
            raise InvalidArgumentError(f"KernelOptions.compiler_options: {name} must be a "
                                       f"string, number or bool, got {item!r}")
    return tuple(sorted(pairs.items()))


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How generation programs are built: kernels, sampling rules, compiler options.

    Attributes:
      attention: ``"auto"``, ``"reference"``, ``"kernel"`` or ``"fused"``.
      gpu_linear: ``"triton"`` or ``"mosaic"``: the GPU linear kernel's backend.
      interpret_variant: ``"gpu"`` or ``"tpu"``: the kernels interpreted off GPU/TPU.
      sampling_rules: ``"auto"``, ``"static"`` or ``"traced"`` (``auto`` is static on a
        GPU only, see :func:`specjax.sampling.static_rules`).
      compiler_options: XLA compiler options, given as a mapping, kept as a sorted tuple
        of (name, value) pairs.
    """

    attention: str = "auto"
    gpu_linear: str = "triton"
    interpret_variant: str = "gpu"
    sampling_rules: str = "auto"
    compiler_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        _choice("attention", self.attention, ATTENTION_IMPLEMENTATIONS)
        _choice("gpu_linear", self.gpu_linear, GPU_LINEAR_BACKENDS)
        _choice("interpret_variant", self.interpret_variant, INTERPRET_VARIANTS)
        _choice("sampling_rules", self.sampling_rules, SAMPLING_RULES)
        object.__setattr__(self, "compiler_options", _compiler_options(self.compiler_options))

    @classmethod
    def default(cls, platform: str) -> "KernelOptions":
        """The default for ``platform`` (``cpu``, ``gpu`` or ``tpu``), the one place the
        defaults are chosen: ``auto`` sampling rules made concrete (static on a GPU),
        everything else as the field defaults."""
        _choice("platform", platform, PLATFORMS)
        return cls().resolved(platform)

    def resolved(self, platform: str) -> "KernelOptions":
        """These options with ``sampling_rules="auto"`` made concrete for ``platform``."""
        if self.sampling_rules != "auto":
            return self
        static = static_rules(platform, "auto")  # the one statement of what auto means
        return self.replace(sampling_rules="static" if static else "traced")

    @classmethod
    def of(cls, value: "KernelOptions | str | None") -> "KernelOptions":
        """``value`` as options: an attention implementation's name (the internal model
        functions' ``attn_impl=``) gets the other fields' defaults."""
        if isinstance(value, cls):
            return value
        return cls() if value is None else cls(attention=value)

    def replace(self, **changes) -> "KernelOptions":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for a run's stats (``stats["kernels"]``) and JSON."""
        values = dataclasses.asdict(self)
        values["compiler_options"] = dict(self.compiler_options)
        return values

    @classmethod
    def from_args(cls, args, platform: str | None = None) -> "KernelOptions":
        """The options of the flags :func:`add_kernel_arguments` added, over
        :meth:`default` for ``platform`` (``None``: over the field defaults; the API
        resolves them for the model's backend)."""
        base = cls() if platform is None else cls.default(platform)
        changes = {name: getattr(args, name) for name in
                   ("attention", "gpu_linear", "interpret_variant", "sampling_rules")
                   if getattr(args, name, None) is not None}
        pairs = getattr(args, "compiler_option", None) or []
        if pairs:
            changes["compiler_options"] = dict(parse_compiler_option(p) for p in pairs)
        return base.replace(**changes)


def parse_compiler_option(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` as (name, value): VALUE as an int, float, or ``true``/``false`` where
    it reads as one, else the string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise InvalidArgumentError(f"--compiler-option {text!r}: expected NAME=VALUE")
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return name, lowered == "true"
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, value


def add_kernel_arguments(parser) -> None:
    """The flags of :class:`KernelOptions` (``specjax generate`` and ``specjax bench``
    both): ``--attention``, ``--gpu-linear``, ``--interpret-variant``,
    ``--sampling-rules`` and ``--compiler-option`` (repeatable). Unset flags are ``None``:
    the backend's default."""
    group = parser.add_argument_group("kernels (KernelOptions; default: the backend's)")
    group.add_argument("--attention", default=None, choices=ATTENTION_IMPLEMENTATIONS,
                       help=_HELP["attention"] + " (default: auto)")
    group.add_argument("--gpu-linear", default=None, choices=GPU_LINEAR_BACKENDS,
                       help=_HELP["gpu_linear"] + " (default: triton)")
    group.add_argument("--interpret-variant", default=None, choices=INTERPRET_VARIANTS,
                       help=_HELP["interpret_variant"] + " (default: gpu)")
    group.add_argument("--sampling-rules", default=None, choices=SAMPLING_RULES,
                       help=_HELP["sampling_rules"] + " (default: auto)")
    group.add_argument("--compiler-option", action="append", default=None,
                       metavar="NAME=VALUE", help=_HELP["compiler_options"])
