"""``make demo`` (``python -m specjax.demo``): what specjax is for, in one run.

The same prompt is generated twice on the default model: with ``ar`` (one target pass per
token, the reference) and with the default method for this backend and temperature.
Printed: the text, each run's tokens/s (compile time apart), the speedup, and whether the
two texts are identical (greedy decoding: they must be; the exit status is 1 if not).
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from specjax import api
from specjax.model import Model

PROMPT = "def fibonacci(n):"


def run(model: Model, prompt: str = PROMPT, max_new_tokens: int = 128,
        out: TextIO | None = None, progress: bool = False) -> bool:
    """Generates ``prompt`` with ``ar`` and with the default method, prints the comparison
    on ``out`` (default: stdout), and returns whether the texts are identical."""
    out = sys.stdout if out is None else out
    default = api.generate(model, prompt, max_new_tokens=max_new_tokens, progress=progress)
    reference = api.generate(model, prompt, method="ar", max_new_tokens=max_new_tokens,
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
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    model = api.load(args.model, progress=True)
    return 0 if run(model, args.prompt, args.max_new_tokens, progress=True) else 1


if __name__ == "__main__":
    sys.exit(main())
