"""The ``specjax`` command line. It parses arguments and calls library functions only.

Errors in user input print one line, ``specjax: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from specjax.errors import SpecjaxError

DEFAULT_MODEL = "smollm2-135m"


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a continuation of PROMPT. Text streams to stdout; "
                                   "a one-line summary (tokens/s, compile time apart) goes to stderr.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help=f"model name, GGUF file, HF or orbax directory, or hub id (default: {DEFAULT_MODEL})")
    p.add_argument("--method", default=None, choices=("ar", "spec", "tree", "ngram", "staged"),
                   help="ar: autoregressive; spec: draft chain (Leviathan/Chen); tree: draft "
                        "token tree verified in one target pass; staged: draft model helped by "
                        "n-gram tables and context lookup (Spector & Re); ngram: n-gram + "
                        "context-lookup trees, no draft model (default: staged when the model "
                        "ships a draft and n-gram tables, as smollm2-135m does; else ar)")
    p.add_argument("--draft", default=None, help="draft model for spec/tree/staged (name, path or "
                                                 "hub id; must share the target's tokenizer; "
                                                 "staged defaults to the shipped draft)")
    p.add_argument("--ngram", default=None,
                   help="staged/ngram: n-gram tables from 'specjax build-ngram' (default: the "
                        "tables shipped for the model)")
    p.add_argument("--tree-budget", type=int, default=None,
                   help="tree/staged: nodes verified per target pass, root included (default: tree 16, staged 6)")
    p.add_argument("--draft-depth", type=int, default=None,
                   help="spec/tree: drafted levels per step (default: 4)")
    p.add_argument("--draft-rounds", type=int, default=None,
                   help="staged: draft passes per step, the first also catching the draft up "
                        "(default: 1)")
    p.add_argument("--proposal", default=None,
                   help="staged/ngram: stage-2 proposal shape, candidates per level, e.g. "
                        "12,7,4,1,1,1 (default: 2,1,1,1,1,1 staged; 2,1,1,1,1,1,1,1 ngram)")
    p.add_argument("--no-lookup", action="store_true",
                   help="staged/ngram: n-gram proposals only, no context lookup")
    p.add_argument("--stage2-prior", default=None, metavar="LOOKUP,NGRAM",
                   help="staged: probabilities flooring the draft's score of lookup / n-gram "
                        "proposals (ranking only; default: 0.7,0.3)")
    p.add_argument("--show-origin", action="store_true",
                   help="colour each streamed token by the stage that proposed it (n-gram, "
                        "lookup, draft, target) and count them in the summary")
    p.add_argument("--draft-width", type=int, default=None,
                   help="tree/staged: children per expanded node and frontier size (default: tree 4, staged 1)")
    p.add_argument("--topology", default=None, choices=("dynamic", "kary"),
                   help="tree: dynamic (best nodes by draft score) or a fixed k-ary tree (default: dynamic)")
    p.add_argument("--verify", default=None, choices=("coupled", "greedy", "match", "rejection"),
                   help="acceptance rule: coupled (default; exact same tokens as ar with the same seed), "
                        "greedy (temperature 0 only), match (sample-then-match), rejection "
                        "(residual rejection sampling)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 disables (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--dtype", default="float32", help="parameter dtype: float32 or bfloat16 (default: float32)")
    p.add_argument("--attn-impl", default="auto", choices=("auto", "reference", "kernel"),
                   help="attention implementation (default: auto = kernel on GPU/TPU, reference on CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=_generate)


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint to specjax's orbax format",
                       description="Convert SRC (model name, GGUF file, HF directory or hub id) "
                                   "into an orbax directory DST (config + params + tokenizer, "
                                   "and specjax_origin.json: what it was made from, so that a "
                                   "converted known model keeps its shipped draft and n-gram "
                                   "tables). DST appears only when the conversion succeeded: "
                                   "Ctrl-C at any moment leaves no DST and no partial "
                                   "directory. On a terminal, shows each phase with its time.")
    p.add_argument("src", help="model name, GGUF file, HF or specjax directory, or hub id")
    p.add_argument("dst", help="the checkpoint directory to create")
    p.add_argument("--dtype", default=None, help="store parameters in this dtype (default: as loaded)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=_convert)


class _Parser(argparse.ArgumentParser):
    """argparse with specjax's error format: one line on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"specjax: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specjax", description="Lossless speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    from specjax.checkpoints_tools import train_draft

    train_draft.add_parser(sub)
    from specjax.checkpoints_tools import ngram_build

    ngram_build.add_parser(sub)
    from specjax.benchmark import cli as bench_cli

    bench_cli.add_parser(sub)
    return parser


def _summary(stats: dict) -> str:
    rate = stats["tokens_per_s"]
    rate = "too fast to time" if rate is None else f"{rate:.1f} tok/s"
    return (f"[{stats['method']}] {stats['new_tokens']} tokens in {stats['seconds']:.2f} s "
            f"({rate}), compile {stats['compile_seconds']:.1f} s, "
            f"target calls {stats['target_calls']}, mean accepted {stats['mean_accepted']:.2f}")


def _progress() -> bool:
    # Progress bars only on a terminal: piped stderr keeps the one-line summary or error.
    return sys.stderr.isatty()


def _check_generate_args(args) -> None:
    """Rejects bad settings before the (slow) model load, with the library's own checks."""
    from specjax import api
    from specjax.errors import InvalidArgumentError
    from specjax.sampling import make_sampling_params

    if not args.prompt:
        raise InvalidArgumentError("prompt is empty")
    if args.max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be an integer >= 1, got {args.max_new_tokens}")
    make_sampling_params(args.temperature, args.top_k, args.top_p, args.seed)
    api.resolve_dtype(args.dtype)


# ANSI colours of token origins for --show-origin (the paper's Figure 3 in a terminal).
ORIGIN_COLOURS = {"ngram": "\033[32m", "lookup": "\033[36m", "draft": "\033[33m",
                  "target": ""}
_RESET = "\033[0m"


def _parse_numbers(text: str, flag: str, kind=int) -> tuple:
    from specjax.errors import InvalidArgumentError

    try:
        return tuple(kind(part) for part in text.split(","))
    except ValueError:
        example = "12,7,4,1,1,1" if kind is int else "0.4,0.1"
        raise InvalidArgumentError(
            f"{flag} must be comma-separated numbers such as {example}, got {text!r}") from None


def _parse_proposal(text: str | None):
    return None if text is None else _parse_numbers(text, "--proposal")


def _default_method(model) -> str:
    """``staged`` when the model ships a draft and n-gram tables, else ``ar``."""
    from specjax import api

    try:
        api.load_ngram_tables(model)
        api.default_draft(model)
    except SpecjaxError:
        return "ar"
    return "staged"


def _generate(args) -> int:
    from specjax import api

    _check_generate_args(args)
    proposal = _parse_proposal(args.proposal)
    model = api.load(args.model, dtype=args.dtype, progress=_progress() and not args.json)
    method = args.method or _default_method(model)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, method=method,
                   chat=args.chat, attn_impl=args.attn_impl, tree_budget=args.tree_budget,
                   draft_depth=args.draft_depth, draft_width=args.draft_width,
                   verify=args.verify, topology=args.topology)
    if method in ("staged", "ngram"):
        options.update(ngram=args.ngram, draft_rounds=args.draft_rounds, proposal=proposal,
                       use_lookup=not args.no_lookup)
        if args.stage2_prior is not None:
            options["stage2_prior"] = _parse_numbers(args.stage2_prior, "--stage2-prior", float)
    elif ((args.ngram, args.draft_rounds, proposal, args.stage2_prior) != (None,) * 4
          or args.no_lookup):
        raise SpecjaxError(f"--ngram, --draft-rounds, --proposal, --stage2-prior and "
                           f"--no-lookup apply to methods staged and ngram, not {method}")
    if args.draft is not None:
        options["draft"] = api.load(args.draft, dtype=args.dtype,
                                     progress=_progress() and not args.json)
    if args.json:
        result = api.generate(model, args.prompt, **options)
        record = {"text": result.text, "tokens": result.tokens, "method": method,
                  "stats": result.stats}
        if args.show_origin:
            record["origins"] = result.origins or ["target"] * len(result.tokens)
        print(json.dumps(record))
        return 0
    tokens: list[int] = []
    printed = ""
    stats = None
    colour = args.show_origin and sys.stdout.isatty()
    for new, names, stats in api.stream_generate(model, args.prompt, origins=True, **options):
        if not new:
            continue
        if args.show_origin:
            # Token by token, so each piece carries its origin's colour.
            for token, origin in zip(new, names):
                tokens.append(token)
                text = api.decode_text(model, tokens)
                piece, printed = text[len(printed):], text
                sys.stdout.write(f"{ORIGIN_COLOURS[origin]}{piece}{_RESET}"
                                 if colour and ORIGIN_COLOURS[origin] else piece)
            sys.stdout.flush()
            continue
        tokens += new
        text = api.decode_text(model, tokens)
        # Print only the stable part: a partial UTF-8 sequence decodes to U+FFFD.
        stable = text.rstrip("\ufffd")
        if stable.startswith(printed):
            sys.stdout.write(stable[len(printed):])
            sys.stdout.flush()
            printed = stable
    if not args.show_origin:
        text = api.decode_text(model, tokens)  # the end: what was held back, U+FFFD included
        sys.stdout.write(text[len(printed):] if text.startswith(printed) else "")
    sys.stdout.write("\n")
    print(_summary(stats), file=sys.stderr)
    if args.show_origin:
        counts = stats["tokens_by_origin"]
        legend = ", ".join(f"{name} {counts.get(name, 0)}" for name in ORIGIN_COLOURS)
        print(f"tokens by origin: {legend}", file=sys.stderr)
    return 0


def _convert(args) -> int:
    from specjax import interrupts
    from specjax.checkpoints_tools.convert import convert

    # Until convert() writes (it holds Ctrl-C back then, and cleans up), nothing needs
    # cleaning up: Ctrl-C ends the process at once, so that no gc callback or import can
    # swallow or garble it. Once DST is in place, Ctrl-C is ignored (see interrupts.command).
    with interrupts.command("specjax: interrupted"):
        convert(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite,
                progress=_progress())
        print(f"wrote {args.dst}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from specjax import interrupts

    parser = build_parser()
    if argv is None:  # run as the program, not called from Python
        interrupts.run_as_program()
    status = run_command(args=parser.parse_args(argv))
    if argv is None:
        # The outcome is decided and printed. A Ctrl-C while the interpreter shuts down
        # (it joins threads, runs jax's exit hooks) would otherwise add a KeyboardInterrupt
        # traceback or change the exit status.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status


def run_command(args) -> int:
    """Runs ``args.func(args)``: user errors print one line (status 2), Ctrl-C 130."""
    try:
        return args.func(args)
    except SpecjaxError as err:
        print(f"specjax: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specjax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
