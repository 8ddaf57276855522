"""``make demo`` (``python -m specjax.demo``): what specjax is for, in one run.

The same prompt is generated twice on the default model: with ``ar`` (one target pass per
token, the reference) and with the default method for this backend and temperature.
Printed: the text, each run's tokens/s (compile time apart), the speedup, and whether the
two texts are identical (greedy decoding: they must be; the exit status is 1 if not).

Both runs are made as ``specjax generate`` makes them: streamed
(:func:`specjax.stream_generate`), with the program's dtype default (``--dtype auto``) and
budget (128 new tokens). So they compile the programs that command runs, which the
persistent compilation cache (:mod:`specjax.compilation_cache`) then hands to it: the quick
start's next command, ``specjax generate "def fibonacci(n):"``, compiles nothing.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from specjax import api
from specjax.harness.cli import resolve_dtype_flag
from specjax.loaded_model import Model

PROMPT = "def fibonacci(n):"
MAX_NEW_TOKENS = 128  # specjax generate's default


def generate_streamed(model: Model, prompt: str, **kwargs) -> api.GenerationResult:
    """:func:`specjax.generate`'s result, made by :func:`specjax.stream_generate` (the
    driver ``specjax generate`` streams text with: its compiled programs are that
    command's).

    Args:
      model: the model.
      prompt: the prompt text.
      **kwargs: :func:`specjax.generate`'s keywords.
    Returns:
      a :class:`~specjax.api.GenerationResult` (text, tokens, stats, origins).
    """
    tokens: list[int] = []
    origins: list[str] = []
    stats: dict = {}
    for new, names, last in api.stream_generate(model, prompt, origins=True, **kwargs):
        tokens += new
        origins += names
        stats = last or stats
    return api.GenerationResult(text=api.decode_text(model, tokens), tokens=tokens,
                                stats=stats, origins=origins)


def run(model: Model, prompt: str = PROMPT, max_new_tokens: int = MAX_NEW_TOKENS,
        out: TextIO | None = None, progress: bool = False) -> bool:
    """Generates ``prompt`` with ``ar`` and with the default method (streamed, as
    ``specjax generate`` does), prints the comparison on ``out`` (default: stdout), and
    returns whether the texts are identical."""
    out = sys.stdout if out is None else out
    default = generate_streamed(model, prompt, max_new_tokens=max_new_tokens,
                                progress=progress)
    reference = generate_streamed(model, prompt, method="ar", max_new_tokens=max_new_tokens,
                                  progress=progress)
    same = default.tokens == reference.tokens and default.text == reference.text
    print(prompt + default.text, file=out)
    print(file=out)
    for result in (reference, default):
        stats = result.stats
        rate = stats["tokens_per_s"]
        print(f"{stats['method']:>7}: {stats['new_tokens']} tokens in {stats['seconds']:.2f} s, "
              + ("too fast to time" if rate is None else f"{rate:.1f} tokens/s")
              + f" (compile {stats['compile_seconds']:.1f} s)", file=out)
    speedup = (default.stats["tokens_per_s"] / reference.stats["tokens_per_s"]
               if default.stats["tokens_per_s"] and reference.stats["tokens_per_s"] else None)
    print(f"speedup: {'n/a' if speedup is None else f'{speedup:.2f}x'}; texts identical: "
          f"{'yes' if same else 'NO'}", file=out)
    print(f"default method: {default.stats['method_choice']}", file=out)
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.demo", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = parser.parse_args(argv)
    # specjax generate's dtype (--dtype auto): bfloat16 on a GPU or TPU, float32 on a CPU.
    model = api.load(args.model, dtype=resolve_dtype_flag("auto"), progress=True)
    return 0 if run(model, args.prompt, args.max_new_tokens, progress=True) else 1


if __name__ == "__main__":
    sys.exit(main())
