"""Imports run one way, checked on the source without importing it.

The check parses every module of ``specjax/`` (``specjax/training/`` included),
``kernels/`` and ``checkpoints_tools/`` under the names they are installed as
(``specjax.kernels``, ``specjax.checkpoints_tools``, see ``pyproject.toml``) and builds
the graph of project imports that run at import time: those at module level, outside
``if TYPE_CHECKING:`` blocks. Importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b``
first, so an import also depends on every package above its target, except the packages
above the importer itself (they are already initialising).

``from specjax import NAME`` for a name of the lazy package face (``specjax/__init__.py``'s
``_EXPORTS``) counts as importing the module that defines it. Imports by
``importlib.import_module`` (the lazy faces of ``specjax`` and ``specjax.kernels``) are not
seen.

Every module is in one of five layers (:func:`layer_of`): the kernels, the core, the
loaders (``specjax.checkpoints_tools``), draft training (``specjax.training``) and the
front (:data:`FRONT`, each module named with what it is). A module not named elsewhere is
core. :data:`MAY_IMPORT` names what each layer may import.

It fails, naming the modules, on
- any import cycle;
- a module importing a layer its own may not (:data:`MAY_IMPORT`);
- a module outside the front using a name of the package face through ``import specjax``
  (``specjax.load``: the face imports the API, so that would be an import of the front
  that the graph cannot see);
- a project import inside a function, outside the allowlists below (an import inside a
  function is for an optional third-party package or a CLI's start-up time, never to hide
  a cycle), or an allowlist entry that no longer matches anything.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package name it is installed as.
PACKAGES = {"specjax": "specjax", "kernels": "specjax.kernels",
            "checkpoints_tools": "specjax.checkpoints_tools"}
KERNELS = "specjax.kernels"
LOADERS = "specjax.checkpoints_tools"
TRAINING = "specjax.training"
# The front: what users call by name, and the commands. Every module of specjax/ that is not
# here, in the kernels, the loaders or training is core.
FRONT = {
    "specjax": "the package face (lazy: each name imports its module on first use)",
    "specjax.api": "load, generate, stream_generate: prompts through a request's program",
    "specjax.requests": "the one request path: checks, the default choice, binding to a model",
    "specjax.calibration": "the default method from this machine's step costs (runs generate)",
    "specjax.cli": "the command line",
    "specjax.launch": "the command's entry point (takes Ctrl-C before the slow imports)",
    "specjax.loading": "models, drafts and n-gram tables by name, through the loaders",
    "specjax.demo": "specjax demo",
    "specjax.harness": "specjax bench: the suite, the transformers peers, reports",
    "specjax.commands": "specjax convert, models, train-draft, build-ngram: flags, by name",
}
# What each layer may import besides itself and specjax.errors (which every layer may).
MAY_IMPORT = {
    "kernels": set(),
    "core": {"kernels"},
    "loaders": {"core", "kernels"},
    "training": {"core", "kernels", "loaders"},
    "front": {"core", "kernels", "loaders", "training"},
}

# (module, function, imported module): imports allowed inside a function, and why.
FUNCTION_IMPORT_ALLOWLIST = {
    # The CLI entry point takes over Ctrl-C before the slow imports.
    ("specjax.launch", "main", "specjax.cli"):
        "CLI start-up",
    # Reading GGUF files needs the optional gguf package; everything else imports without it
    # (tests/test_device_run.py).
    ("specjax.checkpoints_tools.sources", "_load_path",
     "specjax.checkpoints_tools.gguf_loader"):
        "optional gguf package",
    ("specjax.training.ngram_build", "load_tokenizer",
     "specjax.checkpoints_tools.gguf_loader"):
        "optional gguf package",
    ("specjax.training.ngram_build", "load_tokenizer",
     "specjax.checkpoints_tools.gguf_reader"):
        "optional gguf package",
    ("specjax.training.ngram_build", "load_tokenizer",
     "specjax.checkpoints_tools.gguf_tokenizer"):
        "optional gguf package",
}


@dataclass(frozen=True)
class Import:
    """One project import: ``source`` imports ``target`` at ``line`` (in ``function``)."""
    source: str
    target: str
    line: int
    function: str | None  # None at module level


def module_names() -> dict[str, Path]:
    """Every project module by its installed name."""
    names = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join([package, *parts])] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def lazy_exports() -> dict[str, str]:
    """The lazy package face: public name -> the module that defines it."""
    tree = ast.parse((ROOT / "specjax" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "_EXPORTS"
                for target in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("specjax/__init__.py has no _EXPORTS table")


def _imported(node: ast.AST, module: str, is_package: bool, exports: dict) -> list[str]:
    """The dotted names an import statement loads (modules where they are modules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
    names = [f"{base}.{alias.name}" for alias in node.names]
    if base == "specjax":
        names += [exports[alias.name] for alias in node.names if alias.name in exports]
    return [base] + names


def _walk(node: ast.AST, function: str | None):
    """(import node, enclosing function) for every import, skipping TYPE_CHECKING blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for orelse in child.orelse:
                yield from _walk(orelse, function)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, function
        inner = function
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = child.name if function is None else f"{function}.{child.name}"
        yield from _walk(child, inner)


def _depends_on(source: str, target: str, modules: dict[str, Path]) -> list[str]:
    """The project modules that importing ``target`` from ``source`` runs."""
    parts = target.split(".")
    runs = []
    for end in range(1, len(parts) + 1):
        name = ".".join(parts[:end])
        if name in modules and not (source + ".").startswith(name + "."):
            runs.append(name)
    return runs


@functools.cache
def project_imports() -> tuple[Import, ...]:
    """Every import of a project module, at module level or inside a function."""
    modules, exports = module_names(), lazy_exports()
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, function in _walk(tree, None):
            targets = set()
            for name in _imported(node, module, is_package, exports):
                targets.update(_depends_on(module, name, modules))
            found += [Import(module, target, node.lineno, function)
                      for target in sorted(targets)]
    return tuple(found)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for after in sorted(edges.get(node, ())):
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in on_stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def _in_layer(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def _describe(imports) -> str:
    return "\n".join(f"  {i.source}:{i.line} imports {i.target}"
                     + (f" inside {i.function}()" if i.function else "") for i in imports)


def test_the_graph_sees_the_known_edges():
    imports = project_imports()
    # A deliberately wrong graph (no edges, or names the check never resolves) would pass
    # every test below; these edges exist and must be found.
    edges = {(i.source, i.target) for i in imports if i.function is None}
    assert ("specjax.models", "specjax.config") in edges
    assert ("specjax.kernels.attention_gpu", "specjax.errors") in edges
    assert ("specjax.kernels.attention_gpu", "specjax.kernels.layout") in edges
    assert ("specjax.checkpoints_tools.hf", "specjax.config") in edges
    assert ("specjax.training.sample_corpus", "specjax.training.corpus") in edges
    assert ("specjax.training.drafts", "specjax.checkpoints_tools.sources") in edges
    assert ("specjax.commands.train_draft", "specjax.training.loop") in edges


def test_no_import_cycle():
    imports = project_imports()
    edges: dict[str, set[str]] = {}
    for i in imports:
        if i.function is None:
            edges.setdefault(i.source, set()).add(i.target)
    cycles = _cycles(edges)
    message = []
    for cycle in cycles:
        inside = [i for i in imports if i.function is None
                  and i.source in cycle and i.target in cycle]
        message.append(f"cycle among {', '.join(cycle)}:\n{_describe(inside)}")
    assert not cycles, "\n".join(message)


def layer_of(module: str) -> str:
    """``front``, ``kernels``, ``loaders``, ``training`` or (anything else) ``core``."""
    if module in FRONT or any(_in_layer(module, front) for front in FRONT if front != "specjax"):
        return "front"
    for layer, package in (("kernels", KERNELS), ("loaders", LOADERS), ("training", TRAINING)):
        if _in_layer(module, package):
            return layer
    return "core"


def test_every_module_is_in_a_layer_and_each_front_module_exists():
    modules = module_names()
    layers = {layer_of(name) for name in modules}
    assert layers == set(MAY_IMPORT), layers
    assert not set(FRONT) - set(modules), f"FRONT names no module: {set(FRONT) - set(modules)}"
    # The core is most of the library, named by nothing but the absence of a layer.
    assert {"specjax.config", "specjax.state", "specjax.loaded_model", "specjax.kernel_options",
            "specjax.flax_modules", "specjax.verify", "specjax.methods.staged",
            "specjax.families", "specjax.families.cohere"} <= {
        name for name in modules if layer_of(name) == "core"}


def test_each_layer_imports_only_what_it_may():
    imports = project_imports()
    wrong = [i for i in imports if i.target != "specjax.errors"
             and layer_of(i.target) != layer_of(i.source)
             and layer_of(i.target) not in MAY_IMPORT[layer_of(i.source)]]
    assert not wrong, "imports across the layers that MAY_IMPORT does not allow:\n" + "\n".join(
        f"  {i.source}:{i.line} ({layer_of(i.source)}) imports {i.target} "
        f"({layer_of(i.target)})" for i in wrong)


def test_the_rules_read_logits_only():
    """specjax.verify holds the acceptance rules on logits: the target pass that makes the
    logits, the models and the decode state are the methods'."""
    targets = {i.target for i in project_imports() if i.source == "specjax.verify"}
    assert targets <= {"specjax.errors", "specjax.sampling", "specjax.tree"}, targets


def test_only_the_front_uses_the_package_face():
    """``import specjax`` then ``specjax.load``: the face imports specjax.api on first use,
    an import of the front the graph does not see. Below the front a module imports what
    it uses from its own module (``specjax.__file__`` and ``__version__`` are the package's)."""
    exports = lazy_exports()
    users = []
    for name, path in module_names().items():
        if layer_of(name) == "front":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "specjax" and node.attr in exports):
                users.append(f"  {name}:{node.lineno} uses specjax.{node.attr}")
    assert not users, "the package face used below the front:\n" + "\n".join(users)


def _allowed(i: Import) -> bool:
    """Whether an allowlist entry covers ``i``: its target, or a package above the target
    (importing a module runs its packages' ``__init__`` too)."""
    return any((source, function) == (i.source, i.function)
               and (target == i.target or target.startswith(i.target + "."))
               for source, function, target in FUNCTION_IMPORT_ALLOWLIST)


def test_no_project_import_inside_a_function():
    imports = project_imports()
    hidden = [i for i in imports if i.function is not None and not _allowed(i)]
    assert not hidden, ("project imports inside functions (import them at module level; an "
                        "import in a function is for an optional package or a CLI's start-up "
                        f"time):\n{_describe(hidden)}")


def test_every_allowlist_entry_is_still_needed():
    imports = project_imports()
    inside = [i for i in imports if i.function is not None]
    stale = [entry for entry in FUNCTION_IMPORT_ALLOWLIST
             if entry not in {(i.source, i.function, i.target) for i in inside}]
    assert not stale, f"allowlist entries that match no import any more: {stale}"


def test_no_module_keeps_a_deprecated_name():
    """The library was never released: a replaced name is removed, not kept behind a
    warning (no ``DeprecationWarning`` is raised anywhere in the project)."""
    raising = []
    for name, path in module_names().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Name) and node.id == "DeprecationWarning":
                raising.append(f"  {name}:{node.lineno}")
    assert not raising, "DeprecationWarning in the project:\n" + "\n".join(raising)


def test_no_function_imports_the_package_face():
    """``import specjax`` inside a function (the graph above skips the package an importer
    is in: that import is invisible to it) hides a dependency as any function import would."""
    hidden = []
    for name, path in module_names().items():
        for node, function in _walk(ast.parse(path.read_text(), str(path)), None):
            if function is not None and isinstance(node, ast.Import) and any(
                    alias.name == "specjax" for alias in node.names):
                hidden.append(f"  {name}:{node.lineno} inside {function}()")
    assert not hidden, "import specjax inside a function:\n" + "\n".join(hidden)
