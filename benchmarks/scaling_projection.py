"""GPT-2 shapes on this device: decode step, verify pass, draft pass and the memory roofline.

For each GPT-2 size in ``--sizes`` (random weights, ``--dtype``), in one process:

* ``ar`` step: one jitted one-token forward + argmax against a KV cache holding
  ``--prefix`` committed tokens in ``--capacity`` slots;
* verify pass: the same forward over a k-ary tree of N nodes (tree mask), N in ``--nodes``,
  as ``bench_verify.py`` builds it, reported also relative to N = 1;
* draft pass: the target's first ``--draft-layers`` blocks + embedding, its head restricted
  to ``--draft-head-tokens`` tokens (``models.head_subset_params``), over a tree of
  ``--draft-pass-tokens`` tokens;
* the memory roofline of the ``ar`` step: the bytes one pass must read (every parameter
  byte, plus the K/V of the prefix) over the bandwidth a jitted reduction over a
  ``--bandwidth-bytes`` array achieves in the same run (and over the device's peak HBM
  bandwidth where ``bench_kernels.py`` knows it), and the fraction of it the step achieves.

Every program is compiled and warmed up before timing (compile time is reported apart);
the cache is donated and threaded through the calls, as in a decode loop. One sample is
``--inner`` calls dispatched back to back, blocked on the last, divided by ``--inner``; the
samples of all programs of one size are interleaved over ``--repeats`` rounds and the
median is kept.

With ``--acceptance PATH`` (a ``specjax bench`` or ``tune_staged.py`` JSON: the
``mean_accepted`` of each staged system on the real pair, and for ``specjax bench`` the
measured draft passes per target pass) or ``--accepted N:A,...``, it also *projects* the
speedup of speculation at these sizes, ``A(N) * t_ar / (t_verify(N) + rounds * t_draft)``;
the projection is kept apart from the measurements in the JSON.

    python benchmarks/scaling_projection.py --acceptance benchmarks/results/budgets_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax import models  # noqa: E402
from specjax.cache import init_cache  # noqa: E402
from specjax.config import gpt2  # noqa: E402
from specjax.errors import InvalidArgumentError  # noqa: E402
from specjax.tree import ancestor_mask, depths, kary_parents  # noqa: E402

PROJECTION_NOTE = (
    "A projection, not a measurement: speedup = A(N) * t_ar / (t_verify(N) + rounds * "
    "t_draft), with t_ar, t_verify and t_draft measured here on random-weight GPT-2 shapes "
    "and A(N) (tokens per target pass) taken from {source}. It assumes that acceptance "
    "carries over unchanged to these shapes and to a draft of the target's first "
    "{draft_layers} layers, and it leaves out everything but the model passes (sampling, "
    "the acceptance rule, n-gram/lookup proposals, tree building). Only a generation run "
    "measures a speedup.")


# ----------------------------------------------------------------------------- projection


def parse_accepted(text: str, rounds: int = 1) -> list[dict]:
    """Parses ``--accepted N:A,N:A,...`` into acceptance entries.

    Args:
      text: comma-separated ``budget:mean_accepted`` pairs, e.g. ``"4:1.5,8:2.0"``.
      rounds: draft passes per step assumed for every pair.
    Returns:
      ``[{"config": "N:A", "tree_budget": N, "draft_rounds": rounds, "mean_accepted": A}]``.
    Raises:
      InvalidArgumentError: a pair is malformed, N < 1, A outside [1, N], or N repeats.
    """
    entries, seen = [], set()
    for item in text.split(","):
        item = item.strip()
        budget_text, sep, accepted_text = item.partition(":")
        try:
            if not sep:
                raise ValueError
            budget, accepted = int(budget_text), float(accepted_text)
        except ValueError:
            raise InvalidArgumentError(
                f"--accepted: expected N:A pairs such as 4:1.5,8:2.0 (N an integer tree budget, "
                f"A the mean accepted tokens per target pass), got {item!r}") from None
        if budget < 1 or not 1.0 <= accepted <= budget:
            raise InvalidArgumentError(
                f"--accepted {item!r}: need N >= 1 and 1 <= A <= N (a target pass over N "
                "nodes yields between 1 and N tokens)")
        if budget in seen:
            raise InvalidArgumentError(f"--accepted: tree budget {budget} given twice")
        seen.add(budget)
        entries.append({"config": item, "tree_budget": budget, "draft_rounds": int(rounds),
                        "mean_accepted": accepted})
    return entries


def read_acceptance(path: str) -> list[dict]:
    """Acceptance entries of the staged systems in a ``specjax bench`` or ``tune_staged.py``
    JSON.

    * ``specjax bench`` (``aggregates``): every ``staged`` system that ran, one entry per
      system and temperature (a ``--tree-budgets`` sweep gives one per budget), with the
      aggregate ``mean_accepted`` and the *measured* draft passes per target pass as
      ``draft_rounds``.
    * ``tune_staged.py`` (``summary``): a staged configuration is one whose options say
      ``method: staged`` or whose name holds ``-b<budget>-``; its options come from
      ``summary[name]["options"]``, else from its first row, else from the name
      (``-b<budget>``, ``-r<rounds>``, rounds 1 if absent).

    Raises:
      InvalidArgumentError: the file cannot be read or holds no staged configuration.
    """
    try:
        record = json.loads(Path(path).read_text())
        entries = (_bench_acceptance(record) if "aggregates" in record
                   else _tune_acceptance(record))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise InvalidArgumentError(
            f"--acceptance {path}: cannot read a specjax bench or tune_staged.py result "
            f"({type(error).__name__}: {error})") from None
    if not entries:
        raise InvalidArgumentError(
            f"--acceptance {path}: no staged system with a tree budget and a mean_accepted")
    return entries


def _bench_acceptance(record: dict) -> list[dict]:
    entries = []
    for agg in record["aggregates"]:
        if agg.get("method") != "staged" or agg.get("status") != "ok" or not agg.get(
                "tree_budget"):
            continue
        target = agg["target_passes_per_token"]["aggregate"]
        rounds = agg["draft_passes_per_token"]["aggregate"] / target if target else 1.0
        entries.append({"config": f"{agg['system']} T={agg['temperature']:g}",
                        "tree_budget": int(agg["tree_budget"]), "draft_rounds": rounds,
                        "mean_accepted": float(agg["mean_accepted"]["aggregate"])})
    return entries


def _tune_acceptance(record: dict) -> list[dict]:
    summary = record["summary"]
    row_options = {}
    for row in record.get("rows", []):
        row_options.setdefault(row.get("config"), row.get("options") or {})
    entries = []
    for name, values in summary.items():
        options = dict(values.get("options") or row_options.get(name) or {})
        budget_match = re.search(r"-b(\d+)(?:-|$)", name)
        if options.get("method", "staged" if budget_match else None) != "staged":
            continue
        rounds_match = re.search(r"-r(\d+)(?:-|$)", name)
        budget = options.get("tree_budget") or (budget_match and int(budget_match.group(1)))
        rounds = options.get("draft_rounds") or (int(rounds_match.group(1)) if rounds_match
                                                  else 1)
        if not budget or values.get("mean_accepted") is None:
            continue
        entries.append({"config": name, "tree_budget": int(budget), "draft_rounds": int(rounds),
                        "mean_accepted": float(values["mean_accepted"])})
    return entries


def project(times: dict, acceptance: list[dict]) -> dict:
    """Projected speedups: ``A(N) * t_ar / (t_verify(N) + rounds * t_draft)``.

    Args:
      times: ``{size: {"ar_ms": t_ar, "verify_ms": {N: t_verify(N)}, "draft_ms": t_draft}}``
        (``verify_ms`` keys may be ints or digit strings).
      acceptance: entries from :func:`parse_accepted` / :func:`read_acceptance`.
    Returns:
      ``{size: [one dict per entry whose budget was measured, with the inputs and
      "projected_speedup"]}``.
    """
    out = {}
    for size, t in times.items():
        verify = {int(n): ms for n, ms in t["verify_ms"].items()}
        rows = []
        for entry in acceptance:
            n = entry["tree_budget"]
            if n not in verify:
                continue
            step_ms = verify[n] + entry["draft_rounds"] * t["draft_ms"]
            rows.append({**entry, "ar_ms": t["ar_ms"], "verify_ms": verify[n],
                         "draft_ms": t["draft_ms"], "step_ms": step_ms,
                         "projected_speedup": entry["mean_accepted"] * t["ar_ms"] / step_ms})
        out[size] = rows
    return out


# ----------------------------------------------------------------------------- measuring


def device_slug(device_kind: str) -> str:
    """A filesystem-safe lowercase name: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"


def peak_bandwidth(device_kind: str) -> tuple[float | None, str]:
    """(peak HBM bytes/s or None, where it came from), from ``bench_kernels.PEAK_BANDWIDTH``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import bench_kernels
    except Exception as error:  # the kernels package may not import on every backend
        return None, f"bench_kernels.py did not import: {type(error).__name__}: {error}"
    finally:
        sys.path.pop(0)
    peak = bench_kernels.peak_bandwidth(device_kind)
    return peak, ("bench_kernels.PEAK_BANDWIDTH" if peak else
                  f"{device_kind!r} is not in bench_kernels.PEAK_BANDWIDTH")


def tree_inputs(nodes: int, prefix: int, vocab_size: int):
    """Tokens, positions and ancestor mask of a 4-ary tree of ``nodes`` nodes (as
    ``bench_verify.py``)."""
    parents = jnp.asarray(kary_parents(4, 8, nodes) if nodes > 1 else [-1], jnp.int32)
    mask = ancestor_mask(parents, jnp.ones(nodes, bool))
    positions = prefix + depths(parents)
    tokens = jnp.arange(nodes, dtype=jnp.int32) % vocab_size
    return tokens, positions, mask


def tree_bytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def delete(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


@dataclasses.dataclass
class Program:
    """One timed pass: a jitted forward with the cache donated and threaded through."""

    name: str
    config: object
    params: dict
    cache: object
    inputs: tuple
    attn_impl: str

    def __post_init__(self):
        config, attn_impl = self.config, self.attn_impl

        def step(params, cache, tokens, positions, mask):
            logits, cache = models.forward(params, config, tokens, positions, cache, mask,
                                           attn_impl=attn_impl)
            return jnp.argmax(logits, axis=-1), cache

        self.function = jax.jit(step, donate_argnums=1)
        self.samples: list[float] = []

    def call(self):
        out, self.cache = self.function(self.params, self.cache, *self.inputs)
        return out

    def warm_up(self) -> float:
        """Compiles and runs twice; returns the first call's seconds (compile included)."""
        start = time.perf_counter()
        jax.block_until_ready(self.call())
        compile_seconds = time.perf_counter() - start
        jax.block_until_ready(self.call())
        return compile_seconds

    def sample(self, inner: int) -> None:
        start = time.perf_counter()
        for _ in range(inner - 1):
            self.call()
        jax.block_until_ready(self.call())
        self.samples.append((time.perf_counter() - start) / inner)

    @property
    def ms(self) -> float:
        return 1e3 * statistics.median(self.samples)


def measure_bandwidth(num_bytes: int, repeats: int, inner: int) -> dict:
    """Achievable read bandwidth: a jitted sum over a float32 array of ``num_bytes``."""
    array = jnp.ones((max(num_bytes // 4, 1),), jnp.float32)
    jax.block_until_ready(array)
    reduce = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    start = time.perf_counter()
    jax.block_until_ready(reduce(array))
    compile_seconds = time.perf_counter() - start
    jax.block_until_ready(reduce(array))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner - 1):
            reduce(array)
        jax.block_until_ready(reduce(array))
        samples.append((time.perf_counter() - start) / inner)
    seconds = statistics.median(samples)
    num_bytes = array.size * 4
    array.delete()
    return {"bytes": num_bytes, "ms": 1e3 * seconds, "bytes_per_s": num_bytes / seconds,
            "gb_per_s": num_bytes / seconds / 1e9, "compile_seconds": compile_seconds,
            "how": "median over --repeats of --inner back-to-back jitted jnp.sum over a "
                   "float32 array of --bandwidth-bytes"}


def measure_size(size: str, args, nodes: list[int], dtype, bandwidth: float,
                 peak: float | None) -> dict:
    """Times the ar step, the verify passes and the draft pass of one GPT-2 size."""
    config = gpt2(size)
    params = models.init_params(config, jax.random.PRNGKey(0), dtype)
    jax.block_until_ready(params)
    itemsize = jnp.dtype(dtype).itemsize
    param_bytes = tree_bytes(params)
    # K and V of every layer for the committed prefix: what attention must read.
    kv_prefix_bytes = (2 * config.num_layers * args.prefix * config.num_kv_heads *
                       config.head_dim * itemsize)

    def cache(cfg):
        return init_cache(cfg, args.capacity, dtype).replace(length=jnp.int32(args.prefix))

    draft_config = dataclasses.replace(config, num_layers=args.draft_layers)
    draft_params = dict(params, layers=jax.tree.map(lambda a: a[:args.draft_layers],
                                                    params["layers"]))
    draft_params = models.head_subset_params(draft_params, draft_config,
                                             np.arange(args.draft_head_tokens))
    # A draft pass reads its blocks, norms and subset head; of the embedding tables only
    # the rows of its tokens.
    draft_bytes = tree_bytes({k: v for k, v in draft_params.items()
                              if k not in ("embed", "pos_embed")})

    programs = {"ar": Program("ar", config, params, cache(config),
                              tree_inputs(1, args.prefix, config.vocab_size)[:2]
                              + (models.causal_mask(1),), args.attn_impl)}
    for n in nodes:
        programs[f"verify@{n}"] = Program(f"verify@{n}", config, params, cache(config),
                                          tree_inputs(n, args.prefix, config.vocab_size),
                                          args.attn_impl)
    programs["draft"] = Program("draft", draft_config, draft_params, cache(draft_config),
                                tree_inputs(args.draft_pass_tokens, args.prefix,
                                            config.vocab_size), args.attn_impl)
    compile_seconds = {name: p.warm_up() for name, p in programs.items()}
    # Interleave the programs over rounds so machine drift hits all of them alike.
    for _ in range(args.repeats):
        for program in programs.values():
            program.sample(args.inner)

    ar_ms = programs["ar"].ms
    roofline_bytes = param_bytes + kv_prefix_bytes
    roofline_ms = 1e3 * roofline_bytes / bandwidth
    peak_roofline_ms = 1e3 * roofline_bytes / peak if peak else None
    verify = [{"nodes": n, "ms": programs[f"verify@{n}"].ms,
               "relative_to_one_node": programs[f"verify@{n}"].ms / programs["verify@1"].ms,
               "relative_to_ar": programs[f"verify@{n}"].ms / ar_ms} for n in nodes]
    result = {
        "size": size, "num_layers": config.num_layers, "hidden_size": config.hidden_size,
        "num_params": models.num_params(config), "param_bytes": param_bytes,
        "kv_prefix_bytes": kv_prefix_bytes, "roofline_bytes": roofline_bytes,
        "ar_ms": ar_ms,
        "roofline_ms_measured_bandwidth": roofline_ms,
        "fraction_of_roofline_measured_bandwidth": roofline_ms / ar_ms,
        "roofline_ms_peak_bandwidth": peak_roofline_ms,
        "fraction_of_roofline_peak_bandwidth": peak_roofline_ms / ar_ms if peak else None,
        "verify": verify,
        "draft": {"layers": args.draft_layers, "head_tokens": args.draft_head_tokens,
                  "pass_tokens": args.draft_pass_tokens, "ms": programs["draft"].ms,
                  "relative_to_ar": programs["draft"].ms / ar_ms, "bytes": draft_bytes,
                  "roofline_ms_measured_bandwidth": 1e3 * draft_bytes / bandwidth},
        "compile_seconds": compile_seconds,
        "samples_ms": {name: [1e3 * s for s in p.samples] for name, p in programs.items()},
    }
    for program in programs.values():
        delete(program.cache)
    delete(draft_params)
    delete(params)
    programs.clear()
    jax.clear_caches()
    return result


def print_tables(sizes: list[dict], bandwidth: dict, peak: float | None,
                 projection: dict | None) -> None:
    print(f"\nbandwidth: {bandwidth['gb_per_s']:.1f} GB/s measured"
          + (f", peak {peak / 1e9:.0f} GB/s" if peak else ", peak unknown"))
    print(f"{'size':<6} {'params_MB':>9} {'ar_ms':>9} {'roof_ms':>9} {'frac':>6} "
          f"{'roofpk_ms':>9} {'frac_pk':>7} {'draft_ms':>9} {'draft/ar':>8}")
    for s in sizes:
        peak_ms = s["roofline_ms_peak_bandwidth"]
        print(f"{s['size']:<6} {s['param_bytes'] / 1e6:>9.1f} {s['ar_ms']:>9.3f} "
              f"{s['roofline_ms_measured_bandwidth']:>9.3f} "
              f"{s['fraction_of_roofline_measured_bandwidth']:>6.2f} "
              + (f"{peak_ms:>9.3f} {s['fraction_of_roofline_peak_bandwidth']:>7.2f} "
                 if peak_ms else f"{'-':>9} {'-':>7} ")
              + f"{s['draft']['ms']:>9.3f} {s['draft']['relative_to_ar']:>8.2f}")
    print(f"\n{'size':<6} " + " ".join(f"{'N=' + str(v['nodes']):>9}" for v in sizes[0]["verify"])
          + "   (verify ms / ratio to N=1)")
    for s in sizes:
        print(f"{s['size']:<6} " + " ".join(f"{v['ms']:>9.3f}" for v in s["verify"]))
        print(f"{'':<6} " + " ".join(f"{v['relative_to_one_node']:>8.2f}x" for v in s["verify"]))
    if projection:
        print("\nPROJECTION (not a measurement): A(N) * t_ar / (t_verify(N) + rounds * t_draft)")
        print(f"{'size':<6} {'config':<44} {'N':>3} {'r':>2} {'A':>5} {'speedup':>8}")
        for size, rows in projection["by_size"].items():
            for row in rows:
                print(f"{size:<6} {row['config'][:44]:<44} {row['tree_budget']:>3} "
                      f"{row['draft_rounds']:>2} {row['mean_accepted']:>5.2f} "
                      f"{row['projected_speedup']:>8.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="124m,355m,774m,1.5b", help="GPT-2 sizes")
    parser.add_argument("--dtype", default="bfloat16", help="parameter and cache dtype")
    parser.add_argument("--prefix", type=int, default=256, help="committed cache tokens")
    parser.add_argument("--capacity", type=int, default=512, help="cache slots")
    parser.add_argument("--nodes", default="1,2,4,8,16,32,64",
                        help="verify tree budgets N (1 and the --acceptance budgets are added)")
    parser.add_argument("--draft-layers", type=int, default=2,
                        help="draft = the target's first K blocks")
    parser.add_argument("--draft-head-tokens", type=int, default=8192,
                        help="tokens the draft's head scores")
    parser.add_argument("--draft-pass-tokens", type=int, default=12,
                        help="tokens in one draft pass")
    parser.add_argument("--attention", dest="attn_impl", default="auto",
                        choices=("auto", "reference", "kernel"),
                        help="the attention path timed (KernelOptions.attention)")
    parser.add_argument("--bandwidth-bytes", type=int, default=1 << 30,
                        help="array size of the bandwidth probe (default 1 GiB)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (median kept)")
    parser.add_argument("--inner", type=int, default=10,
                        help="calls dispatched back to back per timed sample")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--acceptance", default=None, metavar="PATH",
                        help="a specjax bench or tune_staged.py JSON: mean_accepted of its "
                             "staged systems")
    source.add_argument("--accepted", default=None, metavar="N:A,...",
                        help="mean accepted tokens A per target pass at tree budget N")
    parser.add_argument("--draft-rounds", type=int, default=1,
                        help="draft passes per step assumed for --accepted")
    parser.add_argument("--json", default=None,
                        help="output path (default benchmarks/results/scaling_<device>.json)")
    args = parser.parse_args(argv)

    try:
        sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
        for size in sizes:
            gpt2(size)
        dtype = jnp.dtype(args.dtype)
        if args.acceptance:
            acceptance, acceptance_source = (read_acceptance(args.acceptance),
                                             f"the measured results in {args.acceptance}")
        elif args.accepted:
            acceptance, acceptance_source = (parse_accepted(args.accepted, args.draft_rounds),
                                             "--accepted on the command line")
        else:
            acceptance, acceptance_source = None, None
        nodes = sorted({1, *(int(n) for n in args.nodes.split(",")),
                        *(e["tree_budget"] for e in acceptance or [])})
        for n in nodes:
            kary_parents(4, 8, n)  # validates the budget
        for name in ("prefix", "capacity", "draft_layers", "draft_head_tokens",
                     "draft_pass_tokens", "repeats", "inner", "draft_rounds"):
            if getattr(args, name) < (0 if name == "prefix" else 1):
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be positive")
        widest = max(nodes[-1], args.draft_pass_tokens)
        if args.prefix + widest > args.capacity:
            raise InvalidArgumentError(
                f"--capacity {args.capacity} must hold --prefix {args.prefix} + {widest} "
                "scratch slots")
        if args.draft_head_tokens > 50257:
            raise InvalidArgumentError("--draft-head-tokens must be at most 50257 (GPT-2 vocab)")
        if args.draft_layers > min(gpt2(s).num_layers for s in sizes):
            raise InvalidArgumentError("--draft-layers exceeds a size's layer count")
    except (InvalidArgumentError, ValueError, TypeError) as error:
        parser.error(str(error).splitlines()[0])

    from specjax.harness.environment import machine, write_json

    info = machine()
    versions, git = info.pop("versions"), info.pop("git")
    device = jax.devices()[0]
    peak, peak_source = peak_bandwidth(device.device_kind)
    print(f"device_kind: {device.device_kind}  backend: {jax.default_backend()}  "
          f"jax {jax.__version__}  dtype {dtype.name}  nodes {nodes}", flush=True)

    bandwidth = measure_bandwidth(args.bandwidth_bytes, args.repeats, args.inner)
    print(f"bandwidth probe: {bandwidth['gb_per_s']:.1f} GB/s over "
          f"{bandwidth['bytes'] / 2**20:.0f} MiB", flush=True)
    rows = []
    for size in sizes:
        start = time.perf_counter()
        rows.append(measure_size(size, args, nodes, dtype, bandwidth["bytes_per_s"], peak))
        print(f"{size}: ar {rows[-1]['ar_ms']:.3f} ms, "
              f"{time.perf_counter() - start:.1f} s in all", flush=True)

    if acceptance is None:
        projection = {"skipped": "no --acceptance or --accepted given: nothing projected"}
    else:
        times = {r["size"]: {"ar_ms": r["ar_ms"], "draft_ms": r["draft"]["ms"],
                             "verify_ms": {v["nodes"]: v["ms"] for v in r["verify"]}}
                 for r in rows}
        projection = {"note": PROJECTION_NOTE.format(source=acceptance_source,
                                                     draft_layers=args.draft_layers),
                      "formula": "mean_accepted * ar_ms / (verify_ms + draft_rounds * draft_ms)",
                      "acceptance_source": acceptance_source, "acceptance": acceptance,
                      "by_size": project(times, acceptance)}
    print_tables(rows, bandwidth, peak, projection if acceptance else None)

    path = Path(args.json or ROOT / "benchmarks" / "results" /
                f"scaling_{device_slug(device.device_kind)}.json")
    result = {
        "benchmark": "scaling_projection",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": info, "backend": jax.default_backend(), "versions": versions, "git": git,
        "config": {**{k: v for k, v in vars(args).items() if k != "json"}, "sizes": sizes,
                   "nodes": nodes},
        "bandwidth": {**bandwidth, "peak_hbm_bytes_per_s": peak, "peak_source": peak_source},
        "roofline": "bytes one pass must read = every parameter byte + the K/V bytes of the "
                    "--prefix committed tokens; roofline_ms = bytes / bandwidth; fraction = "
                    "roofline_ms / measured ms (1 = at the roofline)",
        "sizes": rows,
        "projection": projection,
        "load_average_end": os.getloadavg(),
    }
    write_json(path, json.loads(json.dumps(result, default=_json_default)))
    print(f"wrote {path}")
    return 0


def _json_default(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
