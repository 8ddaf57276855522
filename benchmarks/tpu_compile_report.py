"""Compile times and VMEM of the TPU kernels and generation programs, per TPU generation.

Compiles ahead of time on this machine (no TPU needed) with the libtpu pinned by the
``tpu`` extra, through the worker the compile tests use (``tests/tpu_aot.py``), and writes
JSON under ``benchmarks/results/tpu_compile/``:

* ``kernels.json``: per verify-attention shape and target: compile seconds (wall and CPU),
  the kernel's tiling and VMEM estimate per ``pallas_call``, the VMEM the compiler
  allocated to each, and the generation's VMEM;
* ``programs.json``: per generation program (``ar``, ``tree``, ``staged``; greedy and
  coupled acceptance) and target: lower and compile seconds, TPU kernels in the program;
* ``install.json`` (``--install``): time and size of installing the ``tpu`` extra in a
  fresh virtual environment, and of the libtpu-only install ``make tpu-compiler`` does.

Usage (after ``make tpu-compiler``)::

    .venv/bin/python benchmarks/tpu_compile_report.py [--kernels] [--programs] [--install]

Compile times depend on the machine and its load: each file records the CPU count and the
load average, and the CPU seconds next to the wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import tpu_aot  # noqa: E402
from test_tpu_compile import FULL_SWEEP, HEADS  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "tpu_compile"
PROGRAMS = [("ar", None), ("tree", "greedy"), ("tree", "coupled"), ("staged", "greedy"),
            ("staged", "coupled")]


def _commit() -> str:
    """HEAD's commit, with "+changes" when kernels/ or tests/tpu_aot.py differ from it."""
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True,  # noqa: E731
                                    text=True).stdout.strip()
    dirty = run("status", "--porcelain", "--", "kernels", "tests/tpu_aot.py")
    return run("rev-parse", "--short", "HEAD") + ("+changes" if dirty else "")


def environment() -> dict:
    return {"commit": _commit(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2), "python": platform.python_version(),
            "pins": tpu_aot.tpu_requirements(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _job_key(record: dict) -> tuple:
    return tuple(str(record.get(k)) for k in ("target", "method", "verify", "num_heads",
                                              "num_kv_heads", "head_dim", "tokens", "dtype",
                                              "window", "capacity"))


def write(name: str, payload: dict) -> None:
    """Writes ``payload``; its records replace those of the same jobs in an existing file
    and the others are kept (runs over different targets or methods accumulate)."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    if "records" in payload and path.is_file():
        old = json.loads(path.read_text())
        fresh = {_job_key(r) for r in payload["records"]}
        kept = [r for r in old.get("records", []) if _job_key(r) not in fresh]
        for record in kept:
            record.setdefault("environment", old.get("environment"))
        payload = dict(payload, records=kept + payload["records"])
    for record in payload.get("records", []):
        record.setdefault("environment", payload["environment"])
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")


def kernels(targets) -> None:
    jobs = [shape.job(target) for target, shape in FULL_SWEEP if target in targets]
    start = time.perf_counter()
    records = tpu_aot.run_worker(jobs, vmem_report=True, timeout=4 * 3600)
    for record in records:
        record.pop("traceback", None)
        for kernel, used in record.get("vmem_used", {}).items():
            estimate = record["split_bytes" if kernel.endswith("split") else "combine_bytes"]
            record.setdefault("vmem_used_over_estimate", {})[kernel] = round(used / estimate, 3)
    write("kernels.json", {"environment": environment(), "head_shapes": HEADS,
                           "wall_s": round(time.perf_counter() - start, 1),
                           "records": records})


def programs(targets, methods) -> None:
    jobs = [dict(kind="program", target=target, method=method, verify=verify)
            for target in targets for method, verify in methods]
    start = time.perf_counter()
    records = tpu_aot.run_worker(jobs, vmem_report=False, timeout=4 * 3600)
    write("programs.json", {"environment": environment(),
                            "model": "smollm2-135m shapes, bfloat16, abstract parameters; "
                                     "draft: the shipped kind, a one-block EAGLE-3 feature "
                                     "draft (tests/tpu_aot.py, program_configs); "
                                     "attn_impl=kernel",
                            "wall_s": round(time.perf_counter() - start, 1),
                            "records": records})


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def install() -> None:
    """Installs into temporary folders: the extra in a fresh venv, then libtpu alone."""
    pins = tpu_aot.tpu_requirements()
    extra = [f"jax[tpu]=={pins['jax']}", f"libtpu=={pins['libtpu']}"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="specjax-tpu-install-") as tmp:
        venv = Path(tmp) / "venv"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *extra],
                       check=True)
        results["extra_in_fresh_venv"] = {
            "command": "pip install " + " ".join(f'"{r}"' for r in extra),
            "seconds": round(time.perf_counter() - start, 1),
            "venv_bytes": _du(venv)}
        target = Path(tmp) / "tpu-compiler"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(target), f"libtpu=={pins['libtpu']}"], check=True)
        results["make_tpu_compiler"] = {
            "command": "pip install --no-deps --target .venv/tpu-compiler "
                       f"libtpu=={pins['libtpu']}",
            "seconds": round(time.perf_counter() - start, 1), "bytes": _du(target)}
    write("install.json", {"environment": environment(), **results,
                           "note": "pip resolves from this machine's configured indexes; "
                                   "a download from PyPI adds the wheels' transfer "
                                   "(libtpu's is ~213 MB)"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", action="store_true", help="kernel sweep")
    parser.add_argument("--programs", action="store_true", help="generation programs")
    parser.add_argument("--install", action="store_true", help="install time and size")
    parser.add_argument("--targets", nargs="+", default=list(tpu_aot.TARGETS)[:3])
    parser.add_argument("--methods", nargs="+", default=None,
                        help="METHOD or METHOD:VERIFY (default: every program)")
    args = parser.parse_args()
    if not (args.kernels or args.programs or args.install):
        args.kernels = args.programs = args.install = True
    if args.install:
        install()
    if args.kernels:
        kernels(args.targets)
    if args.programs:
        methods = PROGRAMS if args.methods is None else [
            (m.partition(":")[0], m.partition(":")[2] or None) for m in args.methods]
        programs(args.targets, methods)


if __name__ == "__main__":
    main()
