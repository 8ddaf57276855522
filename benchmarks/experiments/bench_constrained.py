"""Structured output on this machine: each method under a JSON-schema constraint against
``ar`` under the same constraint and ``ar`` without it (issue 61).

The prompts ask SmolLM2 (chat template) for a HumanEval function's signature and
docstring as JSON; the schema (:data:`SCHEMA`) fixes the document's shape. Per prompt the
configurations (``--systems``, default all) run interleaved, each compiled first by a short
warm-up call (``--warmup-tokens``; the compile time of a program met later is not in a
run's seconds either), greedy, or at ``--temperature`` with prompt i's seed i under the
default coupled rule: either way the constrained methods' texts must equal constrained
``ar``'s (checked and recorded). Constrained ``ar`` runs twice: with its default
jump-forward and with ``jump_forward=0`` (one target pass per token). Reported per
configuration: median and aggregate tokens/s, tokens per target pass, the median speedup
over constrained ``ar`` (per-prompt ratios), the outputs that are valid documents
(``jsonschema``), the share of the output committed by jump-forward
(``stats["forced_tokens"]``, ``ar`` only) and the share the automaton forced (tokens
emitted in a state that allows one token only: what jump-forward could take). Also the
cold build time of the schema's tables on the model's vocabulary (the disk cache off) and
their size.

``--peer`` adds transformers' ``generate()`` under the same schema through outlines
(:class:`OutlinesPeer`): outlines' logits processor for the schema (its default
``outlines_core`` backend, the processor ``outlines.Generator`` builds for a transformers
model) passed to ``generate(logits_processor=...)``, on the target's weights written from
our parameters (:class:`~specjax.harness.peers.TransformersPeers`; fp32 on the CPU), greedy,
stopping at the model's end-of-sequence token like specjax. Its tokens are compared with
constrained ``ar``'s (recorded, not required: torch and XLA round differently, and outlines
spells the special tokens as text where specjax forbids them). Without the ``outlines``
package (``pip install outlines``) the peer is a row with the reason.

The JSON is written again after every prompt (``prompts_done``, ``complete``), so a run
stopped early keeps the prompts it finished.

Usage::

    .venv/bin/python benchmarks/experiments/bench_constrained.py --limit 32 --max-new-tokens 96 \\
        --systems "ar,ar+schema,ar+schema jf=0,spec+schema" --peer \\
        --json benchmarks/results/cpu/constrained_32_2026-11-30.json
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import statistics
import sys
import time

import jsonschema

import specjax
from specjax import constraints, humaneval
from specjax.api import decode_text
from specjax.constraints import build_tables
from specjax.harness import environment
from specjax.harness.peers import TransformersPeers, one_line
from specjax.loaded_model import encode_prompt

# A function's signature and docstring: name, up to 6 arguments, a one-paragraph summary.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,30}$"},
        "arguments": {"type": "array", "items": {"type": "string", "maxLength": 24},
                      "maxItems": 6},
        "returns": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["name", "arguments", "returns", "summary"],
}
REQUEST = ("Describe this Python function as JSON with the keys name, arguments, returns "
           "and summary.\n\n{prompt}")
CONFIGS = [  # (label, method, constrained, method options)
    ("ar", "ar", False, {}), ("ar+schema", "ar", True, {}),
    ("ar+schema jf=0", "ar", True, {"jump_forward": 0}),
    ("spec+schema", "spec", True, {}), ("tree+schema", "tree", True, {}),
    ("staged+schema", "staged", True, {}),
]
PEER = "hf+outlines+schema"


def run_one(model, prompt: str, method: str, constrained: bool, options: dict,
            max_new_tokens: int, temperature: float = 0.0, seed: int = 0):
    kwargs = dict(method=method, max_new_tokens=max_new_tokens, chat=True,
                  temperature=temperature, seed=seed, **options)
    if constrained:
        kwargs["constraint"] = specjax.JsonSchema(SCHEMA)
    return specjax.generate(model, REQUEST.format(prompt=prompt), **kwargs)


class OutlinesPeer:
    """transformers' ``generate()`` under a JSON schema through outlines' logits processor,
    on the target's weights written from our parameters.

    Attributes:
      status: ``{"status": "ok" | "unavailable", "reason": str | None}``.
      build_seconds: outlines' index build for the schema (``None`` when unavailable).
    """

    def __init__(self, model, schema: dict, torch_threads: int = 0):
        self.model = model
        self.status = {"status": "ok", "reason": None}
        self.build_seconds = None
        try:
            import outlines
            from outlines.backends import get_json_schema_logits_processor
            from transformers import LogitsProcessorList
        except ImportError as err:
            self.status = {"status": "unavailable",
                           "reason": f"{err.name} is not installed (pip install outlines)"}
            return
        self.peers = TransformersPeers(["hf"], model, torch_threads=torch_threads)
        if not self.peers.available("hf"):
            self.status = {"status": "unavailable", "reason": self.peers.status["hf"]["reason"]}
            return
        started = time.perf_counter()
        try:
            # outlines sets the tokenizer's padding side (and a missing pad token): a copy.
            wrapped = outlines.from_transformers(self.peers.transformers_model(),
                                                 copy.deepcopy(model.tokenizer))
            self.processor = get_json_schema_logits_processor("outlines_core", wrapped,
                                                              json.dumps(schema))
        except Exception as err:  # a peer that cannot run is a row, not a crash
            self.status = {"status": "unavailable",
                           "reason": f"outlines cannot build the schema's processor: "
                                     f"{one_line(err)}"}
            return
        self.build_seconds = time.perf_counter() - started
        self.processors = LogitsProcessorList([self.processor])

    def available(self) -> bool:
        return self.status["status"] == "ok"

    def describe(self) -> dict:
        """What the JSON records about the peer."""
        if not self.available():
            return dict(self.status)
        return {**self.status, "outlines": importlib.metadata.version("outlines"),
                "outlines_core": importlib.metadata.version("outlines_core"),
                "backend": "outlines_core",
                "build_seconds": self.build_seconds, **self.peers.describe()}

    def generate(self, ids: list[int], max_new_tokens: int) -> dict:
        """One greedy generation after the prompt ``ids``: tokens (the stop token kept, as
        specjax keeps it), text, seconds, tokens/s."""
        self.peers.tune_threads()
        self.processor.reset()  # a fresh guide per generation
        tokens, seconds = self.peers.generate(
            "hf", ids, max_new_tokens, 0.0, logits_processor=self.processors,
            stop_token_ids=self.model.config.eos_token_ids)
        return {"tokens": tokens, "text": decode_text(self.model, tokens), "seconds": seconds,
                "tokens_per_s": len(tokens) / seconds, "mean_accepted": 1.0}


def automaton_forced(tables, tokens) -> int:
    """How many of ``tokens`` (a constrained output) were emitted in a state that allows
    one token only: the tokens jump-forward may commit without a target pass."""
    state = constraints.INITIAL_STATE
    forced = 0
    for token in tokens:
        forced += int(constraints.forced_token(tables, state)) >= 0
        state = constraints.advance(tables, state, token)
    return forced


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def row_of(index: int, out) -> dict:
    """The JSON row of one specjax generation."""
    return {"prompt": index, "tokens": out.tokens, "text": out.text,
            "seconds": out.stats["seconds"], "tokens_per_s": out.stats["tokens_per_s"],
            "target_calls": out.stats["target_calls"],
            "mean_accepted": out.stats["mean_accepted"],
            "jump_forward_tokens": out.stats.get("forced_tokens"), "valid": valid(out.text)}


def summarize(rows: dict) -> dict:
    """Per configuration: medians over the prompts, aggregates over all tokens, the
    speedup over constrained ``ar`` (per-prompt ratios), valid documents, outputs equal to
    constrained ``ar``'s, and the jump-forward and automaton-forced shares of the tokens
    (``None`` where they do not apply: no jump-forward, or no constraint)."""
    reference = rows["ar+schema"]
    summary = {}
    for label, own in rows.items():
        if not own:
            continue
        tokens = sum(len(r["tokens"]) for r in own)
        jumped = [r.get("jump_forward_tokens") for r in own]
        forced = [r.get("automaton_forced") for r in own]
        summary[label] = {
            "constrained": None not in forced,
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in own),
            "aggregate_tokens_per_s": tokens / sum(r["seconds"] for r in own),
            "median_tokens_per_target_pass": statistics.median(r["mean_accepted"] for r in own),
            "aggregate_tokens_per_target_pass": tokens / sum(
                r.get("target_calls", len(r["tokens"])) for r in own),
            "median_speedup_vs_constrained_ar": statistics.median(
                r["tokens_per_s"] / a["tokens_per_s"] for r, a in zip(own, reference)),
            "valid_documents": sum(r["valid"] for r in own),
            "same_tokens_as_constrained_ar": sum(r["tokens"] == a["tokens"]
                                                 for r, a in zip(own, reference)),
            "tokens": tokens,
            "jump_forward_share": None if None in jumped else sum(jumped) / tokens,
            "automaton_forced_share": None if None in forced else sum(forced) / tokens,
            "prompts": len(own),
        }
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=8, help="HumanEval prompts (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (default 0: greedy); above 0 prompt i "
                             "samples with seed i, so under the default coupled rule every "
                             "method's tokens must still be constrained ar's")
    parser.add_argument("--warmup-tokens", type=int, default=8,
                        help="tokens of each configuration's warm-up call (compiles it)")
    parser.add_argument("--systems", default=",".join(label for label, *_ in CONFIGS),
                        help="comma-separated configurations to run (ar+schema always)")
    parser.add_argument("--peer", action="store_true",
                        help="also run transformers' generate() under the schema through "
                             "outlines (pip install outlines)")
    parser.add_argument("--json", default=None,
                        help="write the result here (again after every prompt)")
    args = parser.parse_args(argv)
    chosen = {s.strip() for s in args.systems.split(",")} | {"ar+schema"}
    unknown = chosen - {label for label, *_ in CONFIGS}
    if unknown:
        parser.error(f"unknown configuration {sorted(unknown)[0]!r}")
    configs = [config for config in CONFIGS if config[0] in chosen]
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.peer and args.temperature > 0:
        parser.error("--peer runs transformers greedy: use it with --temperature 0")

    host = environment.machine()
    model = specjax.load("smollm2-135m")
    started = time.perf_counter()
    tables, info = build_tables(specjax.JsonSchema(SCHEMA), model.tokenizer,
                                model.config.vocab_size, model.config.eos_token_ids,
                                use_cache=False)
    build = {"seconds": time.perf_counter() - started, "states": info.num_states,
             "token_classes": info.num_classes,
             "table_bucket": [info.state_bucket, info.class_bucket],
             "table_bytes": info.table_bytes}
    print(f"tables: {build}", file=sys.stderr)
    peer = OutlinesPeer(model, SCHEMA) if args.peer else None
    if peer is not None:
        print(f"peer: {peer.describe()}", file=sys.stderr)

    prompts = humaneval.humaneval_prompts(args.limit)
    seeds = {prompt: index for index, prompt in enumerate(prompts)}
    systems = [(label, constrained,
                lambda p, n, m=method, c=constrained, o=options: run_one(
                    model, p, m, c, o, n, args.temperature, seeds[p]))
               for label, method, constrained, options in configs]
    if peer is not None and peer.available():
        systems.append((PEER, True, lambda p, n: peer.generate(
            encode_prompt(model, REQUEST.format(prompt=p), chat=True), n)))
    for label, _, run in systems:  # compile each program (and the peer's first call)
        run(prompts[0], args.warmup_tokens)
        print(f"warm: {label}", file=sys.stderr)
    rows = {label: [] for label, _, _ in systems}
    load = []
    for index, prompt in enumerate(prompts):
        order = systems if index % 2 == 0 else systems[::-1]  # alternate who goes first
        for label, constrained, run in order:
            out = run(prompt, args.max_new_tokens)
            row = ({"prompt": index, **out, "valid": valid(out["text"])} if label == PEER
                   else row_of(index, out))
            row["automaton_forced"] = (automaton_forced(tables, row["tokens"])
                                       if constrained else None)
            rows[label].append(row)
        load.append(os.getloadavg()[0])
        print(f"prompt {index} done (load {load[-1]:.2f})", file=sys.stderr)
        summary = summarize(rows)
        result = {"benchmark": "bench_constrained", "schema": SCHEMA, "request": REQUEST,
                  "command": "python benchmarks/experiments/bench_constrained.py "
                             + " ".join(argv if argv is not None else sys.argv[1:]),
                  "max_new_tokens": args.max_new_tokens, "limit": args.limit,
                  "temperature": args.temperature,
                  "prompts_done": index + 1, "complete": index + 1 == len(prompts),
                  "configurations": [{"label": label, "method": method, "constrained": c,
                                      "options": options}
                                     for label, method, c, options in configs],
                  "peer": None if peer is None else peer.describe(),
                  "table_build": build, "summary": summary, "rows": rows, **host,
                  "load_average_per_prompt": load, "load_average_end": os.getloadavg()}
        if args.json:  # a partial result survives a run stopped early
            environment.write_json(args.json, result, warn=index + 1 == len(prompts))
    for label, numbers in summary.items():
        print(f"{label:16s} {numbers}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
