"""Feature drafts for smollm2-135m on a CPU: cached target features, training, a benchmark.

``specjax train-draft --feature-draft`` runs the frozen target on every batch. On a
2-core CPU that doubles a step, so the direction checks of the feature draft (issue 15)
cache the target's features once and train on the cache::

    python benchmarks/experiments/feature_draft_cpu.py extract WORK --tokens 400000
    python benchmarks/experiments/feature_draft_cpu.py train WORK RUN --steps 300 --from-draft \\
        --only fc,feature_norm --lr 3e-4 --feature-weight 0.1
    python benchmarks/experiments/feature_draft_cpu.py bench RUN OUT.json --from-draft --start 8 \\
        --count 12 --temperatures 0,1 --systems ar,staged,spec,spec-f,tree,tree-f

``extract`` tokenizes the standard library the way ``train-draft`` does (files split by a
hash of their path; HumanEval never included), or reads a ``train-draft`` run's
``corpus.npz`` (``--corpus``), and writes the target's final-normed hidden
states of 512-token chunks (float16) for the training stream, the held-out stream and,
when ``--target-corpus`` names a ``train-draft`` ``target_corpus.npz``, the target's own
generations. ``train`` trains a feature draft (one target block, or ``--from-draft``: the
shipped draft with ``fc = [I; 0]``) with the loss of
:mod:`specjax.training.feature_draft` and logs held-out agreement (over the
shipped draft's 8192 head tokens) to ``RUN.jsonl``; the trainable tensors go to
``RUN.npz``. ``bench`` runs the systems interleaved per prompt on HumanEval prompts
``start .. start + count`` (128 new tokens, stop tokens off) and writes per-generation
records and medians; ``spec-f``/``tree-f`` use the trained feature draft, ``spec``/``tree``
/``staged`` the shipped draft.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

CHUNK = 512


def _target():
    import specjax

    return specjax.load("smollm2-135m")


def extract(args) -> None:
    import jax
    import jax.numpy as jnp

    from specjax import models
    from specjax.commands import train_draft

    target = _target()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.corpus:  # a train-draft run's corpus.npz
        with np.load(args.corpus) as data:
            train, held = data["train"], data["heldout"]
    else:
        train, held = train_draft.tokenize_corpus(
            train_draft.stdlib_files(), target.tokenizer, max_tokens=args.tokens + 50_000,
            heldout_fraction=0.02, separator=(target.config.eos_token_ids or (0,))[0])
    streams = {"train": train[: args.tokens], "heldout": held}
    if args.target_corpus:
        with np.load(args.target_corpus) as data:
            streams["target"] = np.concatenate([data["train"], data["heldout"]])
    positions = jnp.arange(CHUNK, dtype=jnp.int32)

    @jax.jit
    def features(tokens):
        return jax.vmap(lambda t: models.hidden_states(target.params, target.config, t,
                                                       positions)[0].astype(jnp.float16))(tokens)

    for name, stream in streams.items():
        chunks = stream[: len(stream) // CHUNK * CHUNK].reshape(-1, CHUNK)
        out = np.lib.format.open_memmap(work / f"{name}.feat.npy", mode="w+",
                                        dtype=np.float16,
                                        shape=(len(chunks), CHUNK, target.config.hidden_size))
        start = time.perf_counter()
        for i in range(0, len(chunks), args.batch):
            out[i: i + args.batch] = np.asarray(features(jnp.asarray(chunks[i: i + args.batch])))
        out.flush()
        np.save(work / f"{name}.tok.npy", chunks)
        print(f"{name}: {chunks.size} tokens, "
              f"{chunks.size / (time.perf_counter() - start):.0f} tokens/s", flush=True)


def _initial(target, from_draft: bool):
    import jax

    from specjax import models
    from specjax.checkpoints_tools.sources import load_bundled_draft
    from specjax.training import feature_draft as fd

    if from_draft:
        draft = load_bundled_draft(target)
        own = {k: v for k, v in draft.params.items() if k != models.HEAD_SUBSET}
        return fd.feature_draft_from_draft(draft.config, jax.tree.map(np.asarray, own))
    return fd.feature_draft_from_target(target.config, target.params, (0,))


def _head_tokens():
    from safetensors.numpy import load_file

    from specjax.checkpoints_tools.sources import assets_dir

    return load_file(str(assets_dir() / "smollm2-135m" / "draft.safetensors"))["head_tokens"]


def train(args) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    from specjax.training import feature_draft as fd

    target = _target()
    work = Path(args.work)
    config, params = _initial(target, args.from_draft)
    trainable, frozen = fd.split_feature_trainable(jax.tree.map(jnp.asarray, params))
    if args.only:
        keep = args.only.split(",")
        frozen = {**frozen, **{k: v for k, v in trainable.items() if k not in keep}}
        trainable = {k: v for k, v in trainable.items() if k in keep}
    rows = fd.head_rows(frozen, config, _head_tokens())
    warmup = min(40, args.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup,
                                                  max(args.steps, warmup + 1),
                                                  end_value=args.lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, 0.0))
    opt_state = optimizer.init(trainable)
    loss_cfg = fd.FeatureLossConfig(unroll=args.unroll, feature_weight=args.feature_weight)
    train_step, eval_step = fd.make_feature_steps(config, loss_cfg, optimizer)
    features = np.load(work / "train.feat.npy", mmap_mode="r")
    tokens = np.load(work / "train.tok.npy")
    evals = {name: (np.load(work / f"{name}.tok.npy"), np.load(work / f"{name}.feat.npy"))
             for name in ("heldout", "target") if (work / f"{name}.tok.npy").exists()}

    def evaluate(p) -> dict:
        out = {}
        for name, (tok, feat) in evals.items():
            got = [jax.device_get(eval_step(p, jnp.asarray(tok[i: i + 1]),
                                            jnp.asarray(feat[i: i + 1]), rows))
                   for i in range(len(tok))]
            out[name] = {k: float(np.mean([g[k] for g in got])) for k in got[0]}
        return out

    rng, key = np.random.default_rng(0), jax.random.PRNGKey(0)
    with open(f"{args.run}.jsonl", "w") as log:
        log.write(json.dumps({"step": 0, **evaluate({**trainable, **frozen})}) + "\n")
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            batch = np.sort(rng.choice(len(tokens), args.batch, replace=False))
            key, sub = jax.random.split(key)
            trainable, opt_state, loss, metrics = train_step(
                trainable, opt_state, frozen, jnp.asarray(tokens[batch]),
                jnp.asarray(features[batch]), rows, sub)
            if step % args.eval_every == 0 or step == args.steps:
                entry = {"step": step, "loss": float(loss),
                         **{k: float(v) for k, v in metrics.items()},
                         "seconds": time.perf_counter() - start,
                         **evaluate({**trainable, **frozen})}
                log.write(json.dumps(entry) + "\n")
                log.flush()
                np.savez(f"{args.run}.npz", **{
                    "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
                    for path, v in jax.tree_util.tree_flatten_with_path(trainable)[0]})


def bench(args) -> None:
    import specjax
    from specjax import api
    from specjax.humaneval import humaneval_prompts

    target = _target()
    config, params = _initial(target, args.from_draft)
    with np.load(f"{args.run}.npz") as trained:
        for name in trained.files:
            *outer, leaf = name.split("/")
            (params[outer[0]] if outer else params)[leaf] = trained[name]
    feature = specjax.Model.from_params(config, params, target.tokenizer,
                                        name="feature-draft").with_head_subset(_head_tokens())
    tree = dict(tree_budget=args.tree_budget, draft_depth=args.tree_depth,
                draft_width=args.tree_width)
    systems = {"ar": dict(method="ar"), "ngram": dict(method="ngram"),
               "staged": dict(method="staged"),
               "spec": dict(method="spec", draft_depth=args.depth),
               "tree": dict(method="tree", **tree),
               "spec-f": dict(method="spec", draft=feature, draft_depth=args.depth),
               "tree-f": dict(method="tree", draft=feature, **tree)}
    names = args.systems.split(",")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    prompts = humaneval_prompts()[args.start: args.start + args.count]
    common = dict(max_new_tokens=128, stop=[], seed=0)
    for temperature in temperatures:  # compile every program before timing
        for name in names:
            specjax.generate(target, api.encode_prompt(target, prompts[0]),
                             temperature=temperature, **common, **systems[name])
    records = []
    for index, prompt in enumerate(prompts, start=args.start):
        ids = api.encode_prompt(target, prompt)
        for temperature in temperatures:
            reference = None
            for name in names:
                out = specjax.generate(target, ids, temperature=temperature, **common,
                                       **systems[name])
                reference = out.tokens if name == "ar" else reference
                records.append({"prompt": index, "temperature": temperature, "system": name,
                                "tokens_per_s": out.stats["tokens_per_s"],
                                "mean_accepted": out.stats.get("mean_accepted", 1.0),
                                "equal_to_ar": out.tokens == reference,
                                "origins": out.stats.get("tokens_by_origin")})
    summary = {}
    for temperature in temperatures:
        ar = {r["prompt"]: r["tokens_per_s"] for r in records
              if r["system"] == "ar" and r["temperature"] == temperature}
        for name in names:
            rows = [r for r in records
                    if r["system"] == name and r["temperature"] == temperature]
            origins: dict = {}
            for r in rows:
                for origin, count in (r["origins"] or {}).items():
                    origins[origin] = origins.get(origin, 0) + count
            total = sum(origins.values()) or 1
            summary[f"{name}@T={temperature:g}"] = {
                "median_speedup": float(np.median([r["tokens_per_s"] / ar[r["prompt"]]
                                                   for r in rows])),
                "median_tokens_per_s": float(np.median([r["tokens_per_s"] for r in rows])),
                "mean_accepted": float(np.mean([r["mean_accepted"] for r in rows])),
                "equal_to_ar": f"{sum(r['equal_to_ar'] for r in rows)}/{len(rows)}",
                "origin_share": {k: round(v / total, 3) for k, v in origins.items()}}
    result = {"command": {k: v for k, v in vars(args).items() if k != "func"},
              "load_average_end": os.getloadavg(),
              "summary": summary, "records": records}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("extract")
    p.add_argument("work")
    p.add_argument("--tokens", type=int, default=400_000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--corpus", default=None,
                   help="a train-draft corpus.npz (default: tokenize the standard library)")
    p.add_argument("--target-corpus", default=None,
                   help="a train-draft target_corpus.npz: the target's generations")
    p.set_defaults(func=extract)
    for name, func in (("train", train), ("bench", bench)):
        p = sub.add_parser(name)
        if name == "train":
            p.add_argument("work")
        p.add_argument("run", help="path prefix of RUN.jsonl / RUN.npz")
        p.add_argument("--from-draft", action="store_true")
        p.set_defaults(func=func)
        if name == "train":
            p.add_argument("--steps", type=int, default=300)
            p.add_argument("--batch", type=int, default=4)
            p.add_argument("--lr", type=float, default=1e-3)
            p.add_argument("--unroll", type=int, default=2)
            p.add_argument("--feature-weight", type=float, default=1.0)
            p.add_argument("--only", default=None, help="comma-separated trainable tensors")
            p.add_argument("--eval-every", type=int, default=100)
        else:
            p.add_argument("out")
            p.add_argument("--start", type=int, default=8)
            p.add_argument("--count", type=int, default=12)
            p.add_argument("--temperatures", default="0,1")
            p.add_argument("--systems", default="ar,staged,spec,spec-f,tree,tree-f")
            p.add_argument("--depth", type=int, default=4)
            p.add_argument("--tree-budget", type=int, default=8)
            p.add_argument("--tree-depth", type=int, default=5)
            p.add_argument("--tree-width", type=int, default=2)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
