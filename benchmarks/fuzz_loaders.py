"""A timed fuzzing campaign over every loader: cases, rejection times, memory.

Runs, per loader, the crafted hostile files of ``tests/test_fuzz_loaders.py`` and
``--cases`` seeded random damages of its small valid files (truncations, bit flips,
extreme values over length/count/offset fields; for orbax, damaged or deleted files of the
checkpoint; for shard indexes, generated shard names; for draft assets, generated
``draft.json`` values and tensors). Every case must load or fail with a one-line
SpecjaxError naming the file, under 5 s, without adding more than 32 MiB + 16x the file
bytes of resident memory, and without writing anything; breaches are counted and listed.

Records per loader: cases, loaded, rejected, violations, rejection seconds (median, p99,
max, and the slowest case), the most resident memory one case added (the process's peak
RSS is reset before each case; memory freed by earlier cases and reused does not count),
and the process's peak RSS at the end. Needs the test extras (hypothesis, and torch for
the tiny files).

    .venv/bin/python benchmarks/fuzz_loaders.py --json benchmarks/results/fuzz_loaders_cpu.json
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000,
                        help="random cases per loader (orbax and index: a fifth of it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import numpy as np

    import test_fuzz_loaders as fuzz
    from specjax.checkpoints_tools.assets import check_draft_asset
    from specjax.checkpoints_tools.gguf_loader import load_gguf
    from specjax.checkpoints_tools.gguf_reader import read_gguf
    from specjax.checkpoints_tools.hf import load_hf_directory
    from specjax.checkpoints_tools.orbax_io import load_orbax
    from specjax.drafters.ngram import load_ngram
    from specjax.harness.environment import machine, write_json

    rng = np.random.default_rng(args.seed)
    scratch = Path(tempfile.mkdtemp(prefix="fuzz-loaders-"))
    started = time.perf_counter()
    try:
        files = fuzz.build_valid_files(scratch / "valid")
        counter = iter(range(10**9))

        def fresh() -> Path:
            directory = scratch / f"case{next(counter)}"
            directory.mkdir()
            return directory

        def damage(size: int, header: int):
            kind = rng.choice(["truncate", "flip", "flip", "smash", "smash"])
            if kind == "truncate":
                return ("truncate", int(rng.integers(0, size)))
            position = int(rng.integers(0, header if rng.random() < 0.5 else size))
            if kind == "flip":
                return ("flip", position, int(rng.integers(1, 256)))
            width = int(rng.choice([1, 2, 4, 8]))
            value = int(rng.choice(fuzz.EXTREMES)) & ((1 << 8 * width) - 1)
            return ("smash", position, width, value)

        results = {}

        def record(loader: str, outcome, named: str, memory: int, case: str) -> None:
            entry = results.setdefault(loader, {"cases": 0, "crafted": 0, "loaded": 0,
                                                "rejected": 0, "violations": [],
                                                "_times": [], "_peaks": [], "_slowest": None})
            entry["cases"] += 1
            entry["crafted"] += case.startswith("crafted")
            if outcome.message is None:
                entry["loaded"] += 1
            else:
                entry["rejected"] += 1
                entry["_times"].append(outcome.seconds)
                if entry["_slowest"] is None or outcome.seconds > entry["_slowest"][0]:
                    entry["_slowest"] = (outcome.seconds, case, outcome.message[-160:])
            entry["_peaks"].append(outcome.peak)
            for problem in fuzz.violations(outcome, named, memory):
                entry["violations"].append(f"{case}: {problem}")

        def case(loader, load, target, label, named=None, watch=None):
            watch = watch or target.parent
            memory = fuzz.memory_allowance(watch)
            try:
                outcome = fuzz.run_case(load, target, watch)
            except Exception as error:  # not a SpecjaxError: a violation
                outcome = fuzz.Outcome(None, 0.0, 0, False)
                results.setdefault(loader, {}).setdefault("escaped", []).append(
                    f"{label}: {type(error).__name__}: {error}"[:300])
            record(loader, outcome, named or target.name, memory, label)

        # GGUF: crafted headers and metadata, then damage of the valid file
        for name, (data, _) in fuzz.CRAFTED_GGUF.items():
            path = fresh() / "crafted.gguf"
            path.write_bytes(data)
            case("gguf", fuzz._load_gguf_all, path, f"crafted {name}")
        base = files["gguf"].read_bytes()
        header = read_gguf(files["gguf"]).data_offset
        for index in range(args.cases):
            mutation = damage(len(base), header)
            path = fresh() / "damaged.gguf"
            path.write_bytes(fuzz.apply(base, mutation))
            case("gguf", load_gguf, path, f"random {index} {mutation}")

        # safetensors
        config_json = (files["hf"] / "config.json").read_bytes()
        for name, (data, _) in fuzz.CRAFTED_SAFETENSORS.items():
            directory = fresh()
            (directory / "config.json").write_bytes(config_json)
            (directory / "model.safetensors").write_bytes(data)
            case("safetensors", lambda p: load_hf_directory(p.parent),
                 directory / "model.safetensors", f"crafted {name}")
        base = (files["hf"] / "model.safetensors").read_bytes()
        header = 8 + int.from_bytes(base[:8], "little")
        for index in range(args.cases):
            mutation = damage(len(base), header)
            directory = fresh()
            (directory / "config.json").write_bytes(config_json)
            (directory / "model.safetensors").write_bytes(fuzz.apply(base, mutation))
            case("safetensors", lambda p: load_hf_directory(p.parent),
                 directory / "model.safetensors", f"random {index} {mutation}")

        # shard index: generated shard names
        parts = ["..", ".", "sub", "x.safetensors", "/", "", "\\", "~", "%2e%2e"]
        for index in range(max(args.cases // 5, 1)):
            name = "/".join(rng.choice(parts, size=int(rng.integers(1, 6))))
            directory = fresh()
            checkpoint, shard_index, shard = fuzz._sharded_copy(files, directory)
            (checkpoint / fuzz.INDEX).write_text(
                json.dumps(fuzz._rename_shard(shard_index, shard, name)))
            case("shard index", lambda p: load_hf_directory(p.parent),
                 checkpoint / fuzz.INDEX, f"random {index} {name!r}", watch=directory)

        # orbax: damaged or deleted files of the checkpoint
        candidates = fuzz._orbax_files(files["orbax"])
        for index in range(max(args.cases // 5, 1)):
            choice = int(rng.integers(0, len(candidates)))
            action = str(rng.choice(["delete", "junk", "truncate", "flip"]))
            seed = int(rng.integers(0, 2**32))
            directory = fresh()
            checkpoint = fuzz._copy(files["orbax"], directory, "ckpt")
            target = fuzz._orbax_files(checkpoint)[choice]
            data = target.read_bytes()
            if action == "delete":
                target.unlink()
            elif action == "junk":
                target.write_bytes(np.random.default_rng(seed).bytes(max(len(data), 1)))
            elif data:
                local = np.random.default_rng(seed)
                mutation = (("truncate", int(local.integers(0, len(data))))
                            if action == "truncate" else
                            ("flip", int(local.integers(0, len(data))),
                             int(local.integers(1, 256))))
                target.write_bytes(fuzz.apply(data, mutation))
            case("orbax", load_orbax, checkpoint,
                 f"random {index} {action} {target.relative_to(checkpoint)}",
                 named=str(checkpoint))

        # n-gram tables
        with np.load(files["ngram"]) as archive:
            tables = {name: archive[name] for name in archive.files}
        for name, (arrays, _) in fuzz._ngram_cases(tables, scratch).items():
            path = fuzz._npz(fresh() / "crafted.npz", arrays)
            case("ngram", load_ngram, path, f"crafted {name}")
        base = files["ngram"].read_bytes()
        for index in range(args.cases):
            mutation = damage(len(base), len(base))
            path = fresh() / "damaged.npz"
            path.write_bytes(fuzz.apply(base, mutation))
            case("ngram", load_ngram, path, f"random {index} {mutation}")

        # draft assets: generated record values and tensors
        from safetensors.numpy import load_file

        asset = files["asset"]
        base_record = json.loads((asset / "draft.json").read_text())
        base_tensors = load_file(str(asset / "draft.safetensors"))
        values = [None, True, 0, 1, -1, 2**40, 1.5, "", "1", "0123456789abcdef", [], {},
                  {"hidden_size": files["config"].hidden_size}]
        for index in range(args.cases):
            if rng.random() < 0.5:
                field = str(rng.choice(["num_layers", "embed_fingerprint", "head_tokens",
                                        "base_config"]))
                value = values[int(rng.integers(0, len(values)))]
                record_, tensors_ = {**base_record, field: value}, base_tensors
                label = f"random {index} {field}={value!r}"
            else:
                name = str(rng.choice(sorted(base_tensors)))
                shape = tuple(int(n) for n in rng.integers(0, 5, int(rng.integers(0, 4))))
                dtype = str(rng.choice(["float16", "float32", "int32", "int64"]))
                record_ = base_record
                tensors_ = {**base_tensors, name: np.zeros(shape, dtype)}
                label = f"random {index} {name}: {dtype} {shape}"

            def check(path, record_=record_, tensors_=tensors_):
                check_draft_asset(path.parent, record_, tensors_, files["config"])

            case("draft asset", check, asset / "draft.json", label, named=str(asset))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summary = {}
    for loader, entry in results.items():
        times = sorted(entry.pop("_times", []))
        peaks = entry.pop("_peaks", [])
        slowest = entry.pop("_slowest", None)
        summary[loader] = {
            **entry,
            "rejection_seconds": {
                "median": statistics.median(times) if times else None,
                "p99": times[int(0.99 * (len(times) - 1))] if times else None,
                "max": times[-1] if times else None},
            "slowest_rejection": None if slowest is None else {
                "seconds": slowest[0], "case": slowest[1], "message_tail": slowest[2]},
            "max_resident_memory_added_bytes": max(peaks) if peaks else None,
        }
    out = {
        "benchmark": "fuzz_loaders",
        "settings": {"cases": args.cases, "seed": args.seed, "seconds_limit": fuzz.SECONDS},
        "wall_seconds": time.perf_counter() - started,
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "loaders": summary,
        "machine": machine(),
    }
    print(json.dumps({loader: {k: v for k, v in entry.items() if k != "violations"}
                      | {"violations": len(entry["violations"])}
                      for loader, entry in summary.items()}, indent=1))
    if args.json:
        write_json(args.json, out)
    broken = sum(len(e["violations"]) + len(e.get("escaped", [])) for e in summary.values())
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
