"""How well drafts predict the target on the target's own HumanEval continuations.

A draft earns its passes only where the target's output goes, and what the target writes
after a HumanEval prompt (the body, then often an explanation and test calls) is not the
library code drafts are trained on. This measures that directly, without decoding::

    python benchmarks/draft_agreement.py --skip 8 --limit 40 --temperature 0 \\
        --drafts shipped=specjax/assets/smollm2-135m new=RUN/asset --json OUT.json

For each prompt the target writes its continuation (``--max-new-tokens``, cut after a stop
token; at ``T = 0`` greedy, at ``T > 0`` sampled, so the text is what
``specjax.generate(..., method="ar")`` produces, with seed ``sample_corpus.row_seed(0, i)``
for the ``i``-th prompt of the range at ``T > 0``). The target and every draft
then read prompt + continuation in one teacher-forced pass, and at every continuation
position (the first predicted from the prompt's last token):

- ``top1``: the draft's top token is the target's top token;
- ``accept``: ``sum_v min(p_v, q_v)`` of the two distributions at ``--temperature`` (at 0,
  the same as ``top1``): the probability that one draft token passes the rejection rule;
- ``chain``: the expected number of draft tokens a depth-``--depth`` chain starting there
  would get accepted, ``sum_k prod_{i<k} accept_i`` (at ``T = 0``: the run of ``top1``
  hits, capped at the depth). Context lookup and the n-gram stage are not counted;
- ``reach`` (drafts whose head scores a subset of the vocabulary, like the shipped one):
  the target's probability mass on the subset at ``--temperature`` (at 0: whether the
  target's token is in it), a ceiling on ``accept``, since a draft never proposes a token
  outside its head.

Positions are pooled over prompts; ``per_prompt`` medians are given too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _logits(model, tokens):
    """float32 logits [T, V] of one teacher-forced pass over ``tokens``."""
    import jax.numpy as jnp

    from specjax.state import bucket

    length = bucket(len(tokens), minimum=128)
    padded = np.zeros(length, np.int32)
    padded[:len(tokens)] = tokens
    run = _compiled(model.config, length)
    return np.asarray(run(model.params, jnp.asarray(padded)))[:len(tokens)]


def continuation_logits(model, prompt, continuation):
    """Logits [N, V] of one pass over prompt + continuation at the N positions that predict
    the continuation's tokens (the first from the prompt's last token)."""
    tokens = np.asarray(list(prompt) + list(continuation), np.int32)
    return _logits(model, tokens)[len(prompt) - 1:len(tokens) - 1]


_PROGRAMS: dict = {}


def _compiled(config, length):
    import jax

    from specjax import models
    from specjax.cache import init_cache

    key = (config, length)
    if key not in _PROGRAMS:
        def run(params, tokens):
            cache = init_cache(config, length, params["embed"].dtype)
            positions = jax.numpy.arange(length, dtype=jax.numpy.int32)
            hidden, _ = models.hidden_states(params, config, tokens, positions, cache,
                                             attn_impl="reference")
            return models.lm_head(params, config, hidden)

        _PROGRAMS[key] = jax.jit(run)
    return _PROGRAMS[key]


def _softmax(logits, temperature):
    z = logits / temperature
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def scores(p_logits, q_logits, temperature: float, depth: int, head=None) -> dict:
    """Per-position ``top1``, ``accept`` and ``chain`` (module docstring) of a draft's
    logits ``q_logits`` against the target's ``p_logits`` (both [N, V]), and ``reach``
    when ``head`` (the ids a subset-head draft scores) is given."""
    top1 = (p_logits.argmax(-1) == q_logits.argmax(-1)).astype(np.float64)
    if temperature == 0:
        accept = top1
    else:
        accept = np.minimum(_softmax(p_logits, temperature),
                            _softmax(q_logits, temperature)).sum(-1)
    reach = {}
    if head is not None:
        inside = np.zeros(p_logits.shape[-1], bool)
        inside[np.asarray(head)] = True
        if temperature == 0:
            reach["reach"] = inside[p_logits.argmax(-1)].astype(np.float64)
        else:
            reach["reach"] = _softmax(p_logits, temperature)[:, inside].sum(-1)
    chain = np.zeros_like(accept)
    for start in range(accept.size):
        survive = 1.0
        for i in range(start, min(start + depth, accept.size)):
            survive *= accept[i]
            chain[start] += survive
    return {"top1": top1, "accept": accept, "chain": chain, **reach}


def head_tokens(draft):
    """The ids a draft's head scores, or None when it scores the whole vocabulary."""
    from specjax import models

    subset = draft.params.get(models.HEAD_SUBSET)
    return None if subset is None else np.asarray(subset["tokens"])


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import specjax
    from specjax.checkpoints_tools.sources import load_bundled_draft
    from specjax.harness.environment import git_commit, machine, versions, write_json
    from specjax.humaneval import humaneval_prompts
    from specjax.training import sample_corpus

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--skip", type=int, default=8, help="first HumanEval prompt index")
    parser.add_argument("--limit", type=int, default=40, help="one past the last index")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16,
                        help="rows per batch when the target writes its continuations")
    parser.add_argument("--drafts", nargs="+", required=True, metavar="NAME=ASSET_DIR",
                        help="draft assets (draft.safetensors + draft.json)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not 0 <= args.skip < args.limit:
        parser.error(f"need 0 <= --skip < --limit, got {args.skip} and {args.limit}")
    if args.temperature < 0 or args.depth < 1:
        parser.error("--temperature must be >= 0 and --depth >= 1")
    named = []
    for item in args.drafts:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--drafts takes NAME=ASSET_DIR, got {item!r}")
        named.append((name, path))

    began = time.time()
    model = specjax.load(args.model)
    drafts = {name: load_bundled_draft(model, path) for name, path in named}
    prompts = humaneval_prompts(args.limit)[args.skip:]
    encoded = [specjax.api.encode_prompt(model, p) for p in prompts]
    stops = tuple(model.config.eos_token_ids)
    continuations = sample_corpus.sample_continuations(
        model.params, model.config, encoded, num_new_tokens=args.max_new_tokens,
        temperature=args.temperature, seed=0, batch_size=args.batch_size, stop_tokens=stops)
    print(f"continuations: {time.time() - began:.0f} s", file=sys.stderr, flush=True)

    heads = {name: head_tokens(draft) for name, draft in drafts.items()}
    pooled = {name: {} for name in drafts}
    per_prompt = {name: [] for name in drafts}
    for index, (prompt, row) in enumerate(zip(encoded, continuations)):
        row = row[row >= 0]
        p = continuation_logits(model, prompt, row)
        for name, draft in drafts.items():
            q = continuation_logits(draft, prompt, row)
            got = scores(p, q, args.temperature, args.depth, heads[name])
            for key, values in got.items():
                pooled[name].setdefault(key, []).append(values)
            per_prompt[name].append({"prompt": args.skip + index, "positions": int(p.shape[0]),
                                     **{k: float(v.mean()) for k, v in got.items()}})
        print(f"prompt {args.skip + index}: " + ", ".join(
            f"{name} top1 {per_prompt[name][-1]['top1']:.3f}" for name in drafts),
            file=sys.stderr, flush=True)

    summary = {}
    for name in drafts:
        values = {k: np.concatenate(v) for k, v in pooled[name].items()}
        summary[name] = {
            "positions": int(values["top1"].size),
            **{k: float(v.mean()) for k, v in values.items()},
            **{f"median_prompt_{k}": statistics.median(r[k] for r in per_prompt[name])
               for k in values}}
    for name, row in summary.items():
        reach = f", reach {row['reach']:.4f}" if "reach" in row else ""
        print(f"{name}: top1 {row['top1']:.4f}, accept {row['accept']:.4f}, "
              f"chain@{args.depth} {row['chain']:.3f}{reach} over {row['positions']} positions")
    if args.json:
        record = {"command": " ".join(sys.argv), "git": git_commit(), "machine": machine(),
                  "versions": versions(), "seconds": round(time.time() - began, 1),
                  "settings": {k: v for k, v in vars(args).items() if k != "json"},
                  "summary": summary, "per_prompt": per_prompt}
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
