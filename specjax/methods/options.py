"""Method options: one frozen dataclass per method, the only place its settings live.

Each class owns its defaults, its validation (in ``__post_init__``, so an invalid object
cannot exist) and the help text of every setting (field metadata, read by the CLI and
``specjax bench``). The options say *how* a method decodes; the resources it decodes with
(the draft model, the n-gram tables) are arguments of :func:`specjax.generate`.

>>> StagedOptions(tree_budget=8)                  # what generate(method=...) takes
>>> method_options("staged", tree_budget=8)       # the same, from a name and keywords
>>> method_options("spec", tree_budget=8)         # InvalidArgumentError: does not apply

Option names are the keyword arguments of :func:`specjax.generate` and, with dashes, the
flags of ``specjax generate`` and ``specjax bench``.

Defaults depend on the backend (:data:`BACKEND_DEFAULTS`): the dataclass defaults are the
CPU's, where a verify pass is compute-bound beyond a few nodes; on a GPU or TPU a pass over
tens of nodes costs about one token's, so bigger trees win. :func:`method_options` applies
them for a method *name* (``generate(method="staged")`` on a GPU model gets the GPU
defaults); an options object is taken as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from specjax.errors import InvalidArgumentError
from specjax.tree import kary_parents, measure_topology, validate_parents

VERIFY_RULES = ("coupled", "greedy", "match", "rejection")
# How a draft picks the children it proposes at T > 0 (rank_children); exactness never
# depends on it, only the tokens per pass do.
DRAFT_RANKINGS = ("auto", "sampled", "argmax")
# ar under a constraint: the most forced tokens one target pass commits beside its sampled
# one (the pass then holds up to JUMP_FORWARD + 1 tokens) on a GPU or TPU, and the largest
# value accepted. The CPU's default is 0: there every step's pass over JUMP_FORWARD + 1
# rows costs more than the forced tokens save (SmolLM2 under a JSON schema, 32 prompts:
# 2.9% of the tokens forced, one pass per token 1.07-1.08x faster in two runs).
JUMP_FORWARD = 8
MAX_JUMP_FORWARD = 64
TOPOLOGIES = ("dynamic", "kary")


def _option(default, help: str, **cli):
    """A dataclass field with its help text (and CLI spelling, when it is not the
    default ``--name-with-dashes VALUE``)."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


def check_verify_rule(verify: str, temperature: float | None = None) -> str:
    """Raises unless ``verify`` names a rule that can run at ``temperature`` (when given).

    Returns:
      ``verify``.
    """
    if verify not in VERIFY_RULES:
        raise InvalidArgumentError(f"unknown verify rule {verify!r}; expected one of "
                                   f"{', '.join(VERIFY_RULES)}")
    if verify == "greedy" and temperature is not None and temperature > 0:
        raise InvalidArgumentError("verify 'greedy' needs temperature 0; use 'coupled'")
    return verify


def _positive(owner: str, name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise InvalidArgumentError(f"{owner}: {name} must be an integer >= 1, got {value!r}")
    return int(value)


def _shape(owner: str, name: str, value) -> tuple[int, ...]:
    try:
        shape = tuple(value)
    except TypeError:
        shape = ()
    if not shape or any(not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1
                        for n in shape):
        raise InvalidArgumentError(f"{owner}: {name} must be a non-empty list of integers "
                                   f">= 1 (candidates per level), got {value!r}")
    return tuple(int(n) for n in shape)


@dataclasses.dataclass(frozen=True)
class MethodOptions:
    """Base of the per-method options (never used directly)."""

    name: ClassVar[str] = ""
    #: The method runs a draft model (``draft=``; a known model's shipped draft by default).
    uses_draft: ClassVar[bool] = False
    #: The method reads n-gram tables (``ngram=``; a known model's shipped ones by default).
    uses_ngram: ClassVar[bool] = False
    summary: ClassVar[str] = ""

    def __new__(cls, *args, **kwargs):
        # Which options the caller set (positionally or by name): the others take the
        # backend's defaults wherever the options are resolved for one (for_backend).
        self = super().__new__(cls)
        names = [field.name for field in dataclasses.fields(cls) if field.init]
        object.__setattr__(self, "_given", frozenset(names[:len(args)]) | frozenset(kwargs))
        return self

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    @property
    def given(self) -> frozenset[str]:
        """The options set explicitly, or all of them once resolved for a backend (by
        :meth:`for_backend` or :func:`method_options`): the others are the dataclass
        defaults, the CPU's, until then."""
        return self._given

    def _with_given(self, given) -> "MethodOptions":
        object.__setattr__(self, "_given", frozenset(given))
        return self

    def for_backend(self, backend: str) -> "MethodOptions":
        """These options with ``backend``'s defaults (:data:`BACKEND_DEFAULTS`) for every
        option not set explicitly: ``StagedOptions()`` on a GPU is what ``"staged"`` is
        there. The options set explicitly stay. The result is resolved: every option
        counts as set (:attr:`given`), so resolving it again, for any backend, keeps it."""
        if self._given == frozenset(self.option_names()):
            return self
        resolved = type(self)(**{**backend_defaults(self.name, backend),
                                 **{name: getattr(self, name) for name in self._given}})
        return resolved._with_given(self.option_names())

    def check_sampling(self, temperature: float) -> None:
        """Raises if these options cannot decode at ``temperature``."""
        del temperature

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes) -> "MethodOptions":
        """A copy with ``changes`` applied (validated; unknown names are an error)."""
        _check_names(type(self), changes)
        return dataclasses.replace(self, **changes)._with_given(self._given | set(changes))

    def to_dict(self) -> dict[str, Any]:
        """``{"method": name, option: value, ...}`` (JSON-ready)."""
        out: dict[str, Any] = {"method": self.name}
        for key, value in dataclasses.asdict(self).items():
            out[key] = list(value) if isinstance(value, tuple) else value
        return out


@dataclasses.dataclass(frozen=True)
class ArOptions(MethodOptions):
    """``ar``: autoregressive decoding, one target pass per token (the reference); under a
    constraint, a run of forced tokens (states allowing one token each) is committed
    without a pass per token (jump-forward, :mod:`specjax.methods.ar`)."""

    name: ClassVar[str] = "ar"
    summary: ClassVar[str] = "autoregressive, one target pass per token"
    jump_forward: int = _option(
        0, "under a constraint, the most forced tokens (a state allowing one token) "
        "committed per target pass beside the sampled one; 0: one pass per token")

    def __post_init__(self):
        value = self.jump_forward
        if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
                or not 0 <= value <= MAX_JUMP_FORWARD):
            raise InvalidArgumentError(f"ar: jump_forward must be an integer in [0, "
                                       f"{MAX_JUMP_FORWARD}], got {value!r}")
        self._set("jump_forward", int(value))


@dataclasses.dataclass(frozen=True)
class _Verified(MethodOptions):
    verify: str = _option(
        "coupled", "acceptance rule: coupled (the same tokens as ar with the same seed; "
        "greedy at temperature 0), greedy (temperature 0 only), match (sample-then-match) "
        "or rejection (residual rejection sampling)", choices=VERIFY_RULES)

    def __post_init__(self):
        check_verify_rule(self.verify)

    def check_sampling(self, temperature: float) -> None:
        check_verify_rule(self.verify, temperature)


@dataclasses.dataclass(frozen=True)
class _Drafted(_Verified):
    draft_ranking: str = _option(
        "auto", "how the draft picks its children at temperature > 0: sampled (from its "
        "probabilities: with the target's noise under coupled, a fresh sample under match "
        "and rejection), argmax (its most likely children), or auto (sampled under coupled "
        "and, for a fixed topology, rejection; argmax under match)", choices=DRAFT_RANKINGS)

    def __post_init__(self):
        super().__post_init__()
        if self.draft_ranking not in DRAFT_RANKINGS:
            raise InvalidArgumentError(
                f"{self.name}: unknown draft_ranking {self.draft_ranking!r}; expected one of "
                f"{', '.join(DRAFT_RANKINGS)}")


@dataclasses.dataclass(frozen=True)
class SpecOptions(_Drafted):
    """``spec``: the draft proposes a chain, the target verifies it in one pass
    (Leviathan et al. / Chen et al.)."""

    name: ClassVar[str] = "spec"
    uses_draft: ClassVar[bool] = True
    summary: ClassVar[str] = "draft chain verified in one target pass (Leviathan/Chen)"
    draft_depth: int = _option(4, "drafted levels per step")

    def __post_init__(self):
        super().__post_init__()
        self._set("draft_depth", _positive(self.name, "draft_depth", self.draft_depth))


@dataclasses.dataclass(frozen=True)
class TreeOptions(_Drafted):
    """``tree``: the draft proposes a token tree, verified in one target pass."""

    name: ClassVar[str] = "tree"
    uses_draft: ClassVar[bool] = True
    summary: ClassVar[str] = "draft token tree verified in one target pass"
    # 8 on the CPU: with the shipped EAGLE-3 draft, 8 nodes beat 16 at T=0 and T=1 (a
    # 16-node pass costs 2.4x a one-row pass there; benchmarks/README.md, "Method defaults",
    # "With the EAGLE-3 draft on the CPU"); accelerators take 32 (BACKEND_DEFAULTS).
    tree_budget: int = _option(8, "nodes verified per target pass, root included")
    draft_depth: int = _option(4, "drafted levels per step")
    draft_width: int = _option(4, "children per expanded node and frontier size")
    topology: Any = _option(
        "dynamic", "dynamic (the best nodes by draft score), kary (a fixed k-ary tree of "
        "draft_width children per node), or a fixed parents list such as -1,0,0,1",
        parse="topology")

    def __post_init__(self):
        super().__post_init__()
        for field in ("tree_budget", "draft_depth", "draft_width"):
            self._set(field, _positive(self.name, field, getattr(self, field)))
        topology = self.topology
        if topology is None:
            topology = "dynamic"
        if not isinstance(topology, str):
            try:
                parents = np.asarray(topology, np.int64)
            except (TypeError, ValueError):
                parents = None
            if parents is None or parents.ndim != 1:
                raise InvalidArgumentError(
                    f"tree: topology must be 'dynamic', 'kary' or a list of parent indices, "
                    f"got {self.topology!r}")
            validate_parents(parents.astype(np.int32))
            topology = tuple(int(p) for p in parents)
        elif topology not in TOPOLOGIES:
            raise InvalidArgumentError(f"tree: topology must be 'dynamic', 'kary' or a list "
                                       f"of parent indices, got {topology!r}")
        self._set("topology", topology)
        if topology == "kary":
            self.fixed_parents  # a budget beyond the complete tree fails here, not at build
        if (topology == "dynamic" and self.verify == "rejection"
                and self.draft_ranking == "sampled"):
            raise InvalidArgumentError(
                "tree: draft_ranking 'sampled' under verify 'rejection' needs a fixed "
                "topology (a dynamic tree's best nodes are no sample of the draft)")
        if topology == "dynamic" and self.tree_budget > self.num_candidates:
            raise InvalidArgumentError(
                f"tree: tree_budget {self.tree_budget} exceeds the {self.num_candidates} "
                f"candidates that draft_depth {self.draft_depth} x draft_width "
                f"{self.draft_width} can draft (1 + W + (depth - 1) x W^2)")

    @property
    def num_candidates(self) -> int:
        """Candidates a dynamic tree is chosen from: the root, the root's top-W children,
        then W x W children of the W-node frontier per further level."""
        width = self.draft_width
        return 1 + width + (self.draft_depth - 1) * width * width

    @property
    def fixed_parents(self) -> tuple[int, ...] | None:
        """The parents of a fixed topology, or ``None`` for a dynamic tree."""
        if self.topology == "dynamic":
            return None
        if self.topology == "kary":
            return tuple(int(p) for p in kary_parents(self.draft_width, self.draft_depth,
                                                      self.tree_budget))
        return self.topology


@dataclasses.dataclass(frozen=True)
class NgramOptions(_Verified):
    """``ngram``: stage-2 trees (n-gram tables + context lookup) verified directly by the
    target; no draft model."""

    name: ClassVar[str] = "ngram"
    uses_ngram: ClassVar[bool] = True
    summary: ClassVar[str] = "n-gram + context-lookup trees, no draft model"
    proposal: tuple[int, ...] = _option(
        (2, 1, 1, 1, 1, 1, 1, 1), "stage-2 proposal shape, candidates per level, e.g. "
        "12,7,4,1,1,1", parse="ints")
    use_lookup: bool = _option(True, "merge context lookup into the stage-2 proposals",
                               flag="--no-lookup",
                               flag_help="n-gram proposals only, no context lookup")

    def __post_init__(self):
        super().__post_init__()
        self._set("proposal", _shape(self.name, "proposal", self.proposal))
        if not isinstance(self.use_lookup, (bool, np.bool_)):
            raise InvalidArgumentError(f"{self.name}: use_lookup must be True or False, got "
                                       f"{self.use_lookup!r}")
        self._set("use_lookup", bool(self.use_lookup))


# The CPU defaults (these dataclass defaults) favour cheap steps: a small tree, one draft
# round, stage-2 priors that let lookups and n-grams outrank weak draft guesses. Each extra
# round or node buys fewer tokens than it costs where a target pass grows with its node
# count (a compute-bound CPU). Measurements: benchmarks/README.md, "Method defaults".
@dataclasses.dataclass(frozen=True)
class StagedOptions(NgramOptions):
    """``staged`` (Spector & Re 2023): the draft model builds the target's tree, helped by
    stage 2 (n-gram tables + context lookup); see :mod:`specjax.methods.staged`."""

    name: ClassVar[str] = "staged"
    uses_draft: ClassVar[bool] = True
    summary: ClassVar[str] = ("draft model helped by n-gram tables and context lookup "
                              "(Spector & Re)")
    proposal: tuple[int, ...] = _option(
        (2, 1, 1, 1, 1, 1), "stage-2 proposal shape, candidates per level, e.g. "
        "12,7,4,1,1,1", parse="ints")
    tree_budget: int = _option(6, "nodes verified per target pass, root included")
    draft_rounds: int = _option(1, "draft passes per step, the first also catching the "
                                   "draft up")
    draft_width: int = _option(1, "children recorded per spine node (the draft's top-W)")
    stage2_prior: tuple[float, float] = _option(
        (0.7, 0.3), "probabilities (lookup, ngram) flooring the draft's score of stage-2 "
        "proposals from each source; ranking only, never exactness", parse="floats",
        metavar="LOOKUP,NGRAM")

    def __post_init__(self):
        super().__post_init__()
        for field in ("tree_budget", "draft_rounds", "draft_width"):
            self._set(field, _positive(self.name, field, getattr(self, field)))
        try:
            prior = tuple(float(p) for p in self.stage2_prior)
        except (TypeError, ValueError):
            prior = ()
        if len(prior) != 2 or not all(0.0 <= p < 1.0 for p in prior):
            raise InvalidArgumentError(f"staged: stage2_prior must be two probabilities in "
                                       f"[0, 1) (lookup, ngram), got {self.stage2_prior!r}")
        self._set("stage2_prior", prior)
        if self.tree_budget > self.num_candidates:
            raise InvalidArgumentError(
                f"staged: tree_budget {self.tree_budget} exceeds the {self.num_candidates} "
                f"candidates that {self.draft_rounds} round(s) x draft_width "
                f"{self.draft_width} with proposal {list(self.proposal)} can draft")

    @property
    def pass_size(self) -> int:
        """Tokens in one later round's draft pass: the draft's own token + the proposal."""
        return 1 + sum(self.proposal)

    @property
    def num_candidates(self) -> int:
        """Candidate nodes one step drafts (the target tree is chosen among them)."""
        width = self.draft_width
        return (1 + width + sum(self.proposal) * (1 + width)
                + (self.draft_rounds - 1) * self.pass_size * (1 + width))


METHODS: dict[str, type[MethodOptions]] = {
    cls.name: cls for cls in (ArOptions, SpecOptions, TreeOptions, NgramOptions, StagedOptions)}


# Defaults on accelerators (the CPU's are the dataclass defaults): greedy acceptance does
# not depend on the device, and a verify pass over tens of nodes costs little more than one
# token there, so trees grow to 32 nodes and the draft gets more rounds and width. `spec`
# keeps depth 4 everywhere: a chain gains a level only where every level above it was
# accepted, so a deeper chain adds little for more sequential draft passes. The TPU takes
# the GPU's. Measurements: benchmarks/README.md, "Method defaults". `ar` jumps forward over
# up to JUMP_FORWARD forced tokens under a constraint (a pass of JUMP_FORWARD + 1 rows costs
# about one token's there; not measured on a GPU yet).
_ACCELERATOR = {
    "staged": dict(tree_budget=32, draft_rounds=4, draft_width=2, stage2_prior=(0.3, 0.1),
                   proposal=(4, 2, 1, 1, 1, 1)),
    "tree": dict(tree_budget=32, draft_depth=6, draft_width=4),
    "ngram": dict(proposal=(4, 2, 1, 1, 1, 1, 1, 1, 1, 1)),
    "ar": dict(jump_forward=JUMP_FORWARD),
}
BACKEND_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {"gpu": _ACCELERATOR,
                                                         "tpu": _ACCELERATOR}


def all_option_fields() -> dict[str, dataclasses.Field]:
    """Every option name of every method, with its field (first definition wins: the
    help text is the same wherever a name appears)."""
    out: dict[str, dataclasses.Field] = {}
    for cls in METHODS.values():
        for field in dataclasses.fields(cls):
            out.setdefault(field.name, field)
    return out


def methods_taking(option: str) -> list[str]:
    return [name for name, cls in METHODS.items() if option in cls.option_names()]


# The jax platform names of each defaults family (backend_of).
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
PLATFORMS = ("cpu", "tpu", *GPU_PLATFORMS)


def backend_of(platform: str) -> str:
    """The defaults family of a jax platform name: ``gpu`` (cuda, rocm), ``tpu`` or
    ``cpu`` (anything else)."""
    platform = str(platform).lower()
    if platform in GPU_PLATFORMS:
        return "gpu"
    return "tpu" if platform == "tpu" else "cpu"


def backend_defaults(method: str, backend: str = "cpu") -> dict[str, Any]:
    """The options of ``method`` whose default differs on ``backend`` from the CPU's."""
    return dict(BACKEND_DEFAULTS.get(backend_of(backend), {}).get(method, {}))


def _check_names(cls: type[MethodOptions], names) -> None:
    for key in names:
        if key in cls.option_names():
            continue
        takers = methods_taking(key)
        if not takers:
            raise InvalidArgumentError(f"unknown option {key!r}")
        own = ", ".join(cls.option_names()) or "none"
        raise InvalidArgumentError(
            f"option {key!r} does not apply to method {cls.name!r} (it applies to "
            f"{', '.join(takers)}; {cls.name}'s options: {own})")


def method_options(method: str | MethodOptions = "ar", *, backend: str = "cpu",
                   **overrides) -> MethodOptions:
    """The options object for ``method`` (a name or an options object) with ``overrides``.

    Args:
      method: a method name (:data:`METHODS`) or a :class:`MethodOptions` instance.
      backend: whose defaults the options not set explicitly take (:data:`BACKEND_DEFAULTS`;
        a jax platform name such as ``cuda`` works too), for a name and for an options
        object alike (:meth:`MethodOptions.for_backend`).
      **overrides: option values; ``None`` values are ignored (they mean "default").
    Returns:
      A validated, frozen options object.
    Raises:
      InvalidArgumentError: an unknown method, an option the method does not take, or an
        invalid value (the message names the option and the method).
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(method, MethodOptions):
        method = method.for_backend(backend)
        return method.replace(**overrides) if overrides else method
    if not isinstance(method, str) or method not in METHODS:
        raise InvalidArgumentError(f"unknown method {method!r}; expected one of "
                                   f"{', '.join(METHODS)}")
    cls = METHODS[method]
    _check_names(cls, overrides)
    return cls(**{**backend_defaults(method, backend), **overrides})._with_given(
        cls.option_names())  # resolved: every option counts as set


def default_value(method: str, option: str):
    """The default of ``option`` for ``method`` (``None`` if the method lacks it)."""
    for field in dataclasses.fields(METHODS[method]):
        if field.name == option:
            return field.default
    return None


def _show(value) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) if isinstance(
        value, tuple) else str(value)


def describe_defaults(option: str) -> str:
    """``"tree 16, staged 6"``: the option's default per method that takes it (the CPU's,
    then any backend whose default differs: ``"staged 6 (gpu, tpu: 16)"``)."""
    values = {}
    for method in methods_taking(option):
        text = _show(default_value(method, option))
        others: dict[str, list[str]] = {}
        for backend in BACKEND_DEFAULTS:
            own = backend_defaults(method, backend)
            if option in own and own[option] != default_value(method, option):
                others.setdefault(_show(own[option]), []).append(backend)
        if others:
            text += " (" + "; ".join(f"{', '.join(b)}: {v}" for v, b in others.items()) + ")"
        values[method] = text
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    return "; ".join(f"{method} {value}" for method, value in values.items())


def fixed_topology_shape(parents) -> tuple[int, int]:
    """(depth, width) of a fixed parents list (see :func:`specjax.tree.measure_topology`)."""
    return measure_topology(np.asarray(parents, np.int32))
