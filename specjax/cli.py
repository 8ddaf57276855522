"""The ``specjax`` command line. It parses arguments and calls library functions only.

Errors in user input print one line, ``specjax: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import re
import signal
import sys
import warnings
from pathlib import Path

import jax
import numpy as np

import specjax
from specjax import api, interrupts, loading, progress
from specjax.checkpoints_tools import sources
from specjax.checkpoints_tools.hf import one_line
from specjax.commands import build_ngram, convert, list_models, train_draft
from specjax.compilation_cache import use_compilation_cache
from specjax.constraints import (JsonSchema, Regex, add_constraint_arguments, check_constraint,
                                 constraint_from_args)
from specjax.drafters import ngram as ngram_lib
from specjax.errors import InvalidArgumentError, PerformanceWarning, SpecjaxError
from specjax.harness import cli as bench_cli
from specjax.kernel_options import KernelOptions, add_kernel_arguments
from specjax.methods import METHODS
from specjax.methods.flags import add_method_arguments, flag_of
from specjax.methods.options import all_option_fields, backend_of
from specjax.state import MAX_BATCH_SIZE

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_BATCH_SIZE = 8


def specjax_version() -> str:
    """The installed package's version (that of the source tree when not installed)."""
    try:
        return importlib.metadata.version("specjax")
    except importlib.metadata.PackageNotFoundError:
        return specjax.__version__


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text from a prompt",
        description="Generate a continuation of PROMPT. Text streams to stdout; a one-line "
                    "summary (tokens/s, compile time apart) goes to stderr. Progress (load, "
                    "compile) shows on a terminal.",
        epilog=f"Without --method, {DEFAULT_MODEL} decodes with "
               f"{loading.describe_defaults(DEFAULT_MODEL)}. A model without shipped assets "
               "decodes with ar. The JSON stats' method_choice says which method ran and why.")
    p.add_argument("prompt", nargs="?", default=None,
                   help="the prompt text; - reads it from standard input (less one final "
                        "newline); or give --prompts-file")
    p.add_argument("--prompts-file", default=None, metavar="PATH",
                   help="generate for every prompt of a JSONL file (- for standard input), "
                        "in batches, writing one "
                        "JSON object per prompt (id, index, prompt, text, tokens, stats) to "
                        "--output or stdout. Each line is a JSON object with a \"prompt\" "
                        "(a string, or a list of token ids) and optionally an \"id\", a "
                        "\"seed\" (default: --seed) and its own constraint, a \"regex\" or "
                        "a \"json_schema\" (instead of --regex/--json-schema), or just a "
                        "JSON string")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help=f"with --prompts-file: prompts decoded together per compiled program, "
                        f"1 to {MAX_BATCH_SIZE} (default: {DEFAULT_BATCH_SIZE})")
    p.add_argument("--output", default=None, metavar="PATH",
                   help="with --prompts-file: write the JSONL results here (default: stdout)")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help=f"model name, GGUF file, HF or orbax directory, or hub id (default: "
                        f"{DEFAULT_MODEL})")
    p.add_argument("--method", default=None, choices=tuple(METHODS),
                   help="; ".join(f"{name}: {cls.summary}" for name, cls in METHODS.items())
                        + " (default: the method measured fastest on this backend at this "
                          "temperature, ar where none beat it; see below)")
    p.add_argument("--draft", default=None,
                   help="spec/tree/staged: draft model: a shipped draft's name ("
                        + (", ".join(loading.shipped_draft_names()) or "none") + "), "
                        "first-layers:K (the target's first K layers, untrained), a draft "
                        "asset folder (specjax train-draft), or a model name/path/hub id "
                        "sharing the target's tokenizer (default: the model's shipped draft)")
    p.add_argument("--ngram", default=None, metavar="PATH",
                   help="staged/ngram: n-gram tables from 'specjax build-ngram' (default: the "
                        "tables shipped for the model)")
    add_method_arguments(p)
    p.add_argument("--show-origin", action="store_true",
                   help="colour each streamed token by the stage that proposed it (n-gram, "
                        "lookup, draft, target) and count them in the summary")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens to generate at most (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0,
                   help="keep the k most likely tokens; 0 disables (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus mass in (0, 1]; 1 disables (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="end the text before the first STRING generated (repeatable; "
                        "checked on the host after each step)")
    p.add_argument("--chat", action="store_true",
                   help="apply the model's chat template to the prompt")
    add_constraint_arguments(p)
    p.add_argument("--dtype", default="auto",
                   help="parameter dtype: float32, bfloat16, or auto = bfloat16 on GPU/TPU, "
                        "float32 on CPU, where bfloat16 runs ~7x slower (default: auto, as "
                        "specjax bench)")
    add_kernel_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of streaming text")
    p.set_defaults(func=_generate)


class _Parser(argparse.ArgumentParser):
    """argparse with specjax's error format: one line on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"specjax: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if getattr(parsed, "command", None) == "generate" and parsed.prompt is None \
                and parsed.prompts_file is None:
            self.error("the following arguments are required: prompt (or --prompts-file)")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specjax", description="Lossless speculative decoding in JAX.")
    parser.add_argument("--version", action="version",
                        version=f"specjax {specjax_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    convert.add_parser(sub)
    list_models.add_parser(sub)
    train_draft.add_parser(sub)
    build_ngram.add_parser(sub)
    bench_cli.add_parser(sub)
    return parser


def _counted(count: int, noun: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _summary(stats: dict) -> str:
    rate = stats["tokens_per_s"]
    rate = "too fast to time" if rate is None else f"{rate:.1f} tok/s"
    fallbacks = stats.get("fallbacks") or ()
    return (f"[{stats['method']}] {_counted(stats['new_tokens'], 'token')} in "
            f"{stats['seconds']:.2f} s ({rate}), compile {stats['compile_seconds']:.1f} s, "
            f"target calls {stats['target_calls']}, mean accepted {stats['mean_accepted']:.2f}"
            + (f", {_counted(len(fallbacks), 'kernel fallback')} (--json lists them)"
               if fallbacks else ""))




def check_generate_args(args, constraints: list | None = None) -> tuple[api.Request, str]:
    """Every setting of ``specjax generate``, checked before anything loads: the prompt
    flags here, the rest by :func:`specjax.api.request` (the API's own checks and
    default-method choice), whose errors are told in flags. ``constraints``: one per line
    of a prompts file that gives its own (``None``: that line unconstrained), in place of
    ``--regex``/``--json-schema``.

    Returns:
      (the request, the parameter dtype).
    """
    if args.prompts_file is not None:
        if args.prompt is not None:
            raise InvalidArgumentError("give a prompt or --prompts-file, not both")
        size = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
        if not 1 <= size <= MAX_BATCH_SIZE:
            raise InvalidArgumentError(f"--batch-size must be in [1, {MAX_BATCH_SIZE}], "
                                       f"got {size}")
        if args.output is not None:
            check_output_path(args.output)
    else:
        for flag, value in (("--batch-size", args.batch_size), ("--output", args.output)):
            if value is not None:
                raise InvalidArgumentError(f"{flag} applies to --prompts-file only")
        if args.prompt == "-":  # standard input, less the one final newline echo adds
            data = sys.stdin.buffer.read()
            try:
                args.prompt = data.decode("utf-8").removesuffix("\n")
            except UnicodeDecodeError as error:
                raise InvalidArgumentError(f"the prompt on standard input is not UTF-8 text "
                                           f"(byte 0x{data[error.start]:02x} at offset "
                                           f"{error.start})") from None
        if not args.prompt:
            raise InvalidArgumentError("prompt is empty")
        _check_utf8(args.prompt, "the prompt")
    if args.stop is not None and not all(args.stop):
        raise InvalidArgumentError("--stop needs a non-empty STRING")
    backend = backend_of(jax.default_backend())
    kernels = KernelOptions.from_args(args, backend)
    flags = {name: getattr(args, name) for name in all_option_fields()
             if getattr(args, name, None) is not None}
    constraint = constraint_from_args(args)
    if constraint is not None and constraints is not None:
        raise InvalidArgumentError("--prompts-file gives constraints per line: drop "
                                   "--regex/--json-schema (or the lines' own)")
    if constraints is not None:
        constraint = list(constraints)
    if constraint is not None:
        flags["constraint"] = constraint
    assets = sources.known_origin(args.model)
    try:
        request = api.request(
            backend=backend, assets=assets, method=args.method,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
            chat=args.chat, kernels=kernels, draft=args.draft, ngram=args.ngram, **flags)
    except InvalidArgumentError as error:
        message = _flag_draft(_with_flag_names(_cli_words(str(error)), args))
        if args.method is None and "does not apply" in message:
            # A method's flag without --method: say why the default is a method without it.
            reason = loading.choose_default_method(assets, backend, args.temperature)[1]
            message += f"; without --method the default here is {reason.split(' (')[0]}"
        raise InvalidArgumentError(message) from None
    _check_gpu_linear(args.gpu_linear, request.kernels, backend)
    check_compiler_options(request.kernels.compiler_options)
    if args.ngram is not None:
        _check_ngram_file(args.ngram)
    return request, bench_cli.resolve_dtype_flag(args.dtype)


def _check_gpu_linear(given: str | None, kernels: KernelOptions, backend: str) -> None:
    """Refuses a ``--gpu-linear`` that nothing would run: off a GPU, or without the
    row-tiled kernels (``--attention fused``) that it picks the backend of."""
    if given is None:
        return
    if backend != "gpu":
        raise InvalidArgumentError(f"--gpu-linear {given}: the GPU linear kernel runs on a "
                                   f"GPU only (this backend is {backend}); drop the flag")
    if kernels.attention != "fused":
        raise InvalidArgumentError(f"--gpu-linear {given} picks the backend of the row-tiled "
                                   f"kernels of --attention fused (here: --attention "
                                   f"{kernels.attention}); add --attention fused or drop it")


def check_compiler_options(options) -> None:
    """Refuses, before anything loads, an XLA compiler option that XLA does not accept:
    each ``(name, value)`` of ``options`` compiles a trivial program with it (milliseconds),
    and XLA's refusal becomes one line naming the flag.

    Raises:
      InvalidArgumentError: an unknown option name, or a value of the wrong type.
    """
    for name, value in options:
        try:
            jax.jit(lambda x: x + 1).lower(np.float32(0)).compile({name: value})
        except Exception as error:  # jax's runtime error; its class moved between versions
            # "INVALID_ARGUMENT: No such compile option: 'x'": the status code dropped.
            reason = re.sub(r"^[A-Z_]+: ", "", " ".join(str(error).split()))
            shown = str(value).lower() if isinstance(value, bool) else value
            raise InvalidArgumentError(f"--compiler-option {name}={shown}: XLA does not "
                                       f"accept it ({reason})") from None


def _check_ngram_file(path: str) -> None:
    """Reads the ``--ngram`` tables before the model loads, so that a missing or damaged
    file is the first thing said (their vocabulary is checked against the model's once it
    loads)."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise InvalidArgumentError(f"--ngram {path}: is a directory; give the .npz file of "
                                   "'specjax build-ngram'")
    if not file.is_file():
        raise InvalidArgumentError(f"--ngram {path}: no such file")
    try:
        ngram_lib.load_ngram(file)
    except SpecjaxError as error:
        message = str(error)
        message = message[len(str(file)) + 2:] if message.startswith(f"{file}: ") else message
        raise InvalidArgumentError(f"--ngram {path}: {message}") from None


def _with_flag_names(message: str, args) -> str:
    """``message`` (about method options) with options named as their flags:
    ``tree_budget 99`` -> ``--tree-budget 99`` (each one given, and every one whose name
    cannot be an English word: ``draft_depth``); ``option 'use_lookup'`` -> ``--no-lookup``."""
    message = re.sub(r"\boption '(\w+)'", lambda m: flag_of(m.group(1))
                     if m.group(1) in all_option_fields() else m.group(0), message)
    for name in all_option_fields():
        if getattr(args, name, None) is not None or "_" in name:
            message = re.sub(rf"(?<![\w-]){name}\b", flag_of(name), message)
    return message


def _flag_draft(message: str) -> str:
    """A draft error from the library (``draft 'x': ...``) as the flag's: ``--draft x``."""
    return re.sub(r"^(no )?draft '([^']*)'", r"--draft \2", message)


def _check_utf8(text: str, what: str) -> None:
    # Arguments that are not UTF-8 reach Python as lone surrogates (PEP 383).
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidArgumentError(f"{what} is not UTF-8 text (an undecodable byte at "
                                   f"character {error.start})") from None


def check_output_path(path: str) -> None:
    """Rejects an ``--output`` that cannot be written, before anything loads: a directory,
    or a file in a directory that does not exist or is not writable."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise InvalidArgumentError(f"--output {path}: is a directory; give a file path")
    parent = target.parent
    if not parent.is_dir():
        raise InvalidArgumentError(f"--output {path}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK) or (
            target.exists() and not os.access(target, os.W_OK)):
        raise InvalidArgumentError(f"--output {path}: not writable")


# ANSI colours of token origins for --show-origin (the paper's Figure 3 in a terminal).
ORIGIN_COLOURS = {"ngram": "\033[32m", "lookup": "\033[36m", "draft": "\033[33m",
                  "target": ""}
_RESET = "\033[0m"
COLOUR_NAMES = {"ngram": "green", "lookup": "cyan", "draft": "yellow", "target": "plain"}


def read_prompts_file(path: str) -> list[dict]:
    """The prompts of a ``--prompts-file``: one ``{"id", "prompt", "seed"}`` per line.

    Each non-blank line is a JSON object with a ``"prompt"`` (a string or a list of token
    ids) and optionally an ``"id"`` (any JSON value; default: the line's 0-based prompt
    index) and a ``"seed"`` (an int; default: ``--seed``), or a JSON string (the prompt).

    Raises:
      InvalidArgumentError: a missing or empty file, a line that is not such JSON
        (naming its line number).
    """
    if path == "-":  # standard input
        data = sys.stdin.buffer.read()
    else:
        file = Path(path).expanduser()
        if file.is_dir():
            raise InvalidArgumentError(f"--prompts-file {path}: is a directory; give a JSONL "
                                       "file")
        if not file.is_file():
            raise InvalidArgumentError(f"--prompts-file {path}: no such file")
        try:
            data = file.read_bytes()
        except OSError as error:
            raise InvalidArgumentError(f"--prompts-file {path}: {error.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise InvalidArgumentError(f"--prompts-file {path}, line {line}: not UTF-8 text "
                                   f"(byte 0x{data[error.start]:02x})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--prompts-file {path}, line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise InvalidArgumentError(f"{where}: not JSON ({error.msg})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or "prompt" not in item:
            raise InvalidArgumentError(f"{where}: expected an object with a \"prompt\" field "
                                       f"or a string")
        prompt = item["prompt"]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            raise InvalidArgumentError(f"{where}: \"prompt\" must be a string or a list of "
                                       f"token ids")
        if len(prompt) == 0:
            raise InvalidArgumentError(f"{where}: the prompt is empty")
        seed = item.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidArgumentError(f"{where}: \"seed\" must be an integer")
        rows.append({"id": item.get("id", len(rows)), "prompt": prompt, "seed": seed,
                     "constraint": _line_constraint(item, where)})
    if not rows:
        raise InvalidArgumentError(f"--prompts-file {path}: no prompts in it")
    return rows


def _line_constraint(item: dict, where: str):
    """A prompts-file line's own constraint (its ``"regex"`` or ``"json_schema"``),
    checked as ``--regex``/``--json-schema`` are; ``None`` without one."""
    given = [key for key in ("regex", "json_schema") if item.get(key) is not None]
    if len(given) > 1:
        raise InvalidArgumentError(f"{where}: give \"regex\" or \"json_schema\", not both")
    if not given:
        return None
    key = given[0]
    try:
        constraint = Regex(item[key]) if key == "regex" else JsonSchema(item[key])
        check_constraint(constraint)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{where}: \"{key}\": {error}") from None
    return constraint


def _generate_file(args, model, rows: list[dict], request: api.Request) -> int:
    """Generates for every prompt of ``rows`` in batches of ``--batch-size`` and writes
    one JSON line per prompt as each batch ends; prints a summary line to stderr."""
    size = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
    for row in rows:
        if row["seed"] is None:
            row["seed"] = args.seed
    sink = sys.stdout if args.output is None else open(args.output, "w", encoding="utf-8")
    tokens = seconds = compile_seconds = 0.0
    try:
        for first in range(0, len(rows), size):
            chunk = rows[first: first + size]
            changes = dict(seed=tuple(row["seed"] for row in chunk))
            if any(row["constraint"] is not None for row in rows):  # each line's own
                changes["constraint"] = [row["constraint"] for row in chunk]
            try:
                results = api.generate(model, [row["prompt"] for row in chunk],
                                       request=request.replace(**changes))
            except InvalidArgumentError as error:  # name the line, not the batch's row
                message = str(error)
                if message.startswith("prompts["):
                    index = first + int(message[len("prompts["): message.index("]")])
                    message = f"prompt {index} (id {rows[index]['id']!r})" + \
                        message[message.index("]") + 1:]
                raise InvalidArgumentError(message) from None
            for offset, (row, result) in enumerate(zip(chunk, results)):
                record = {"id": row["id"], "index": first + offset, "prompt": row["prompt"],
                          "text": result.text, "tokens": result.tokens,
                          "method": result.stats["method"], "stats": result.stats}
                if args.show_origin:
                    record["origins"] = result.origins or ["target"] * len(result.tokens)
                sink.write(json.dumps(record) + "\n")
            sink.flush()
            tokens += sum(len(r.tokens) for r in results)
            seconds += results[0].stats["seconds"]
            compile_seconds += results[0].stats["compile_seconds"]
    finally:
        if sink is not sys.stdout:
            sink.close()
    rate = f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "too fast to time"
    print(f"[{request.options.name}] {_counted(len(rows), 'prompt')} in batches of {size}: "
          f"{_counted(int(tokens), 'token')} in {seconds:.2f} s ({rate} in total), compile "
          f"{compile_seconds:.1f} s", file=sys.stderr)
    return 0


def _generate(args) -> int:
    request, dtype = check_generate_args(args)
    rows = None if args.prompts_file is None else read_prompts_file(args.prompts_file)
    if rows is not None and any(row["constraint"] is not None for row in rows):
        request, dtype = check_generate_args(args, [row["constraint"] for row in rows])
    # Nothing here needs finishing or removing on Ctrl-C: it ends the process at once, at
    # any moment (loading, compiling, prefill, generation), with one line.
    with interrupts.exit_on_interrupt("specjax: interrupted") as watch:
        status = _generate_watched(args, request, dtype, rows, watch)
        watch.finished()
    return status


def _generate_watched(args, request: api.Request, dtype, rows, watch) -> int:
    with progress.phases(enabled=not args.json) as shown:
        with shown.phase(f"loading {args.model}"):
            model = loading.load(args.model, dtype=dtype, progress=shown.enabled)
            if request.kernels.attention == "fused":  # one kernel for q|k|v, one for gate|up
                model = model.with_fused_projections()
        if request.options.uses_draft:
            with shown.phase(f"loading draft {args.draft or '(shipped)'}"):
                try:
                    request = request.replace(draft=loading.resolve_draft(
                        model, args.draft, progress=shown.enabled))
                except InvalidArgumentError as error:
                    raise InvalidArgumentError(_flag_draft(str(error))) from None
        try:
            return _generate_loaded(args, model, rows, request, shown, watch)
        except InvalidArgumentError as error:  # limits that depend on the loaded model
            raise InvalidArgumentError(_with_flag_names(_cli_words(str(error)), args)) \
                from None


def _cli_words(message: str) -> str:
    """A library error about the loaded model in the CLI's words: keywords as flags, and
    the way to give token ids."""
    message = re.sub(r"\bmax_new_tokens\b", "--max-new-tokens", message)
    return message.replace(
        "has no tokenizer: pass a list of token ids",
        'has no tokenizer: give token ids with --prompts-file, a JSONL file of lines such as '
        '{"prompt": [1, 2, 3]}')


def _generate_loaded(args, model, rows, request: api.Request, shown, watch) -> int:
    """Generates with the loaded model: the prompts file, --json, or streamed text."""
    if rows is not None:
        return _generate_file(args, model, rows, request)
    if args.json:
        result = api.generate(model, args.prompt, request=request)
        record = {"text": result.text, "tokens": result.tokens,
                  "method": request.options.name,
                  "stats": result.stats}
        if args.show_origin:
            record["origins"] = result.origins or ["target"] * len(result.tokens)
        print(json.dumps(record))
        return 0
    stream = api.stream_generate(model, args.prompt, origins=True, request=request)
    with shown.phase("compiling and prefilling"):
        first = next(stream)
    _print_stream(model, itertools.chain([first], stream), args.show_origin, watch,
                  request.stop_strings)
    return 0


def _print_stream(model, stream, show_origin: bool, watch, stop: tuple[str, ...] = ()
                  ) -> None:
    """Prints the streamed text to stdout and the summary to stderr. On Ctrl-C
    (:func:`interrupts.exit_on_interrupt`, told by ``watch.line_open``) or an error the
    text printed so far stays, ended by a newline, so that the one line that follows
    starts a line of its own."""
    tokens: list[int] = []
    try:
        stats = _print_tokens(model, stream, show_origin, watch, tokens, stop)
    except BaseException:
        if tokens:
            with watch.output:
                sys.stdout.write("\n")
                sys.stdout.flush()
                watch.line_open = False
        raise
    print(_summary(stats), file=sys.stderr)
    if show_origin:
        counts = stats["tokens_by_origin"]
        colour = sys.stdout.isatty()  # the text was coloured: the counts are the legend

        def shown(name: str) -> str:
            if not colour:
                return f"{name} {counts.get(name, 0)}"
            paint = ORIGIN_COLOURS[name]
            label = f"{paint}{name}{_RESET}" if paint else name
            return f"{label} {counts.get(name, 0)} ({COLOUR_NAMES[name]})"

        print(f"tokens by origin: {', '.join(map(shown, ORIGIN_COLOURS))}", file=sys.stderr)


def _print_tokens(model, stream, show_origin: bool, watch, tokens: list[int],
                  stop: tuple[str, ...] = ()) -> dict:
    """Writes the stream's text to stdout as it comes, appending to ``tokens``; returns
    the stats. With ``stop`` strings the text ends before the first one, and the last
    characters that could begin one are held back until it is known."""
    hold = max(map(len, stop), default=1) - 1

    def visible(final: bool) -> str:
        text = api.decode_text(model, tokens)
        found = api.first_stop(text, stop) if stop else None
        if found is not None:
            return text[:found[0]]
        if final:  # the end: what was held back, U+FFFD included
            return text
        # Only the stable part: a partial UTF-8 sequence decodes to U+FFFD.
        text = text.rstrip("\ufffd")
        return text[:len(text) - hold] if hold else text

    printed = ""
    stats = None
    colour = show_origin and sys.stdout.isatty()
    for new, names, stats in stream:
        if not new:
            continue
        if show_origin:
            # Token by token, so each piece carries its origin's colour.
            with watch.output:
                for token, origin in zip(new, names):
                    tokens.append(token)
                    text = visible(False)
                    if text.startswith(printed) and len(text) > len(printed):
                        piece, printed = text[len(printed):], text
                        watch.line_open = True  # before the write: a Ctrl-C may come between
                        sys.stdout.write(f"{ORIGIN_COLOURS[origin]}{piece}{_RESET}"
                                         if colour and ORIGIN_COLOURS[origin] else piece)
                sys.stdout.flush()
                watch.line_open = bool(printed)
            continue
        tokens += new
        text = visible(False)
        if text.startswith(printed) and len(text) > len(printed):
            with watch.output:  # the exit's newline comes after this write, not inside it
                # Open before the write: a Ctrl-C between the two then still ends the line.
                watch.line_open = True
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
            printed = text
    text = visible(True)
    with watch.output:
        sys.stdout.write(text[len(printed):] if text.startswith(printed) else "")
        sys.stdout.write("\n")
        sys.stdout.flush()
        watch.line_open = False
    return stats


def main(argv: list[str] | None = None) -> int:
    try:
        # Building the parser takes a moment (each option's help names its methods'
        # defaults): a Ctrl-C then is one line too (the slow tier's Ctrl-C test caught a
        # traceback there, 2026-12-02).
        parser = build_parser()
        if argv is None:  # run as the program, not called from Python
            interrupts.run_as_program()
            problem = use_compilation_cache()
            if problem is not None:
                print(f"specjax: warning: {problem}", file=sys.stderr)
        args = parser.parse_args(argv)
    except KeyboardInterrupt:  # before the command sets its own handling of Ctrl-C
        print("specjax: interrupted", file=sys.stderr)
        return 130
    status = run_command(args=args)
    if argv is None:
        # The outcome is decided and printed. A Ctrl-C while the interpreter shuts down
        # (it joins threads, runs jax's exit hooks) would otherwise add a KeyboardInterrupt
        # traceback or change the exit status.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status


_CACHE_ERRORS = ("Error reading persistent compilation cache entry",
                 "Error writing persistent compilation cache entry")


def run_command(args) -> int:
    """Runs ``args.func(args)``: user errors print one line (status 2), Ctrl-C 130; a
    :class:`~specjax.errors.PerformanceWarning` prints one line and the command goes on."""
    show = warnings.showwarning
    cache_reported = False

    def show_one_line(message, category, filename, lineno, file=None, line=None):
        nonlocal cache_reported
        file = sys.stderr if file is None else file
        if issubclass(category, PerformanceWarning):
            print(f"specjax: warning: {message}", file=file)
        elif str(message).startswith(_CACHE_ERRORS):
            # JAX warns per entry, on every run, and never rewrites an unreadable entry.
            if not cache_reported:
                cache_reported = True
                print(f"specjax: warning: the compilation cache "
                      f"({jax.config.jax_compilation_cache_dir}) failed ({one_line(message)}); "
                      "compiling instead; delete that directory if this repeats", file=file)
        else:
            show(message, category, filename, lineno, file, line)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_one_line
            return args.func(args)
    except SpecjaxError as err:
        print(f"specjax: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specjax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
