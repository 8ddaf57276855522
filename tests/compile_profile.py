"""Where the suite's time goes: ``pytest --compile-profile=DIR`` (``make test-profile``).

Each test process (every xdist worker) writes ``DIR/<pid>.jsonl``: one line per test (wall
seconds, this process's CPU seconds, and its subprocesses' CPU seconds, which are where the
CLI, sharding and multi-host tests spend theirs) and one line per JAX compilation event
inside it (tracing, lowering to MLIR, XLA's backend compile, a persistent-cache hit or
miss), with the function's name. The programs that :func:`specjax.decode.compiled` builds
carry their driver's name (``run_to_completion``, ``step_batch``, ...), so a generation
program is told apart from a forward pass or an eager operation. At the end the run's
totals, and the test files that cost most, go to ``DIR/summary.json`` and to the terminal.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import time
from pathlib import Path

import jax
import pytest

from specjax import decode

# The names decode.compiled gives its programs, from the drivers it compiles (a renamed
# driver fails here rather than going uncounted). JAX reports a trace under the function's
# name and the lowering and compile as ``jit(name)``.
GENERATION_PROGRAMS = frozenset(decode._program_name(driver) for driver in (
    decode.run_to_completion, decode.run_batch_to_completion, decode._start_batch_and_steps,
    decode._more_steps, decode._start_batch, decode._step_batch, decode._start,
    decode._step))
_STAGES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "backend"}
_CACHE = {"/jax/compilation_cache/cache_hits": "cache_hits",
          "/jax/compilation_cache/cache_misses": "cache_misses"}


def _function(name: str) -> str:
    return name[4:-1] if name.startswith("jit(") and name.endswith(")") else name


def _cpu_seconds(who) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class Recorder:
    """Registered in each test process: writes that process's lines."""

    def __init__(self, directory: Path):
        self.file = open(directory / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
        self.test = "(collection)"
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _write(self, **row) -> None:
        self.file.write(json.dumps(row) + "\n")

    def _duration(self, event: str, seconds: float, **kwargs) -> None:
        stage = _STAGES.get(event)
        if stage:
            self._write(kind=stage, test=self.test, seconds=seconds,
                        name=str(kwargs.get("fun_name", "")))

    def _event(self, event: str, **kwargs) -> None:
        if event in _CACHE:
            self._write(kind=_CACHE[event], test=self.test)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.test = item.nodeid
        start = (time.perf_counter(), _cpu_seconds(resource.RUSAGE_SELF),
                 _cpu_seconds(resource.RUSAGE_CHILDREN))
        yield
        self._write(kind="test", test=item.nodeid, wall=time.perf_counter() - start[0],
                    cpu=_cpu_seconds(resource.RUSAGE_SELF) - start[1],
                    children=_cpu_seconds(resource.RUSAGE_CHILDREN) - start[2])
        self.test = f"(between tests, after {item.nodeid})"


def summarize(directory: Path, top: int = 15) -> dict:
    """The run's totals from every ``DIR/*.jsonl``: seconds per compile stage, compiles
    and cache hits, generation programs, and per test file (worker seconds, CPU,
    subprocesses' CPU, compile seconds), costliest first."""
    totals = collections.Counter()
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            kind, file = row["kind"], row["test"].split("::")[0]
            if kind == "test":
                for field in ("wall", "cpu", "children"):
                    totals[field] += row[field]
                    files[file][field] += row[field]
                totals["tests"] += 1
            elif kind in ("cache_hits", "cache_misses"):
                totals[kind] += 1
            else:
                generation = _function(row["name"]) in GENERATION_PROGRAMS
                totals[f"{kind}_seconds"] += row["seconds"]
                files[file]["compile"] += row["seconds"]
                if generation:
                    totals[f"generation_{kind}_seconds"] += row["seconds"]
                if kind == "backend":
                    totals["compiles"] += 1
                    totals["generation_programs"] += generation
    by_file = sorted(files.items(), key=lambda item: -item[1]["wall"])
    summary = {"totals": {k: round(v, 1) for k, v in sorted(totals.items())},
               "files": [{"file": f, **{k: round(v, 1) for k, v in sorted(c.items())}}
                         for f, c in by_file]}
    (directory / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return {**summary, "files": summary["files"][:top]}


def report_lines(summary: dict) -> list[str]:
    t = summary["totals"]
    compile_seconds = sum(t.get(f"{k}_seconds", 0) for k in ("trace", "lower", "backend"))
    generation = sum(t.get(f"generation_{k}_seconds", 0) for k in ("trace", "lower", "backend"))
    lines = [
        f"{t.get('tests', 0):.0f} tests: {t.get('wall', 0):.0f} worker-seconds, "
        f"{t.get('cpu', 0):.0f} s CPU in the test processes and {t.get('children', 0):.0f} s "
        f"in their subprocesses",
        f"compiling: {compile_seconds:.0f} s (tracing {t.get('trace_seconds', 0):.0f}, "
        f"lowering {t.get('lower_seconds', 0):.0f}, XLA {t.get('backend_seconds', 0):.0f}) in "
        f"{t.get('compiles', 0):.0f} compiles ({t.get('cache_hits', 0):.0f} persistent-cache "
        f"hits); generation programs: {t.get('generation_programs', 0):.0f}, {generation:.0f} s",
        f"{'file':44s} {'worker s':>8s} {'CPU s':>7s} {'subproc':>7s} {'compile':>7s}"]
    for row in summary["files"]:
        lines.append(f"{row['file'][:44]:44s} {row.get('wall', 0):8.1f} {row.get('cpu', 0):7.1f} "
                     f"{row.get('children', 0):7.1f} {row.get('compile', 0):7.1f}")
    return lines
