"""Ahead-of-time compilation for real TPU targets on a machine without a TPU.

libtpu (the ``tpu`` extra's pin) holds the whole TPU compiler: XLA's TPU backend and Mosaic,
the compiler of Pallas TPU kernels. With a topology description
(``jax.experimental.topologies.get_topology_desc``) a jitted function lowers and compiles
for that TPU generation on the CPU; ``.compile()`` raises what the TPU compiler raises
(Mosaic's E2003 unproven alignment, VMEM exhaustion, ...). Compiling is not running:
numerics stay with the interpreter tests (``tests/test_kernels.py``).

This module is the worker the compile tests (``tests/test_tpu_compile.py``,
``tests/test_kernel_windows_tpu.py``) and ``benchmarks/tpu_compile_report.py`` run in a
subprocess with ``JAX_PLATFORMS=cpu`` and libtpu importable, so that the rest of the suite
never loads libtpu::

    python tests/tpu_aot.py JOBS.json OUT.json [--vmem-report]
    python tests/tpu_aot.py --requirement     # the pinned libtpu, for pip

``JOBS.json`` is a list of jobs (see :func:`run_job`), ``OUT.json`` gets one record per
job: whether it compiled, the compiler's error, the lower and compile seconds and, with
``--vmem-report``, the VMEM the compiler allocated to each Pallas kernel (read from the
VMEM report libtpu writes when asked to dump it) next to the kernel's own estimate.
The parent (:func:`run_worker`) finds libtpu and sets the environment.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where `make tpu-compiler` installs libtpu (pip --target), outside the main environment:
# a venv with libtpu initialises the TPU backend in every JAX process, which logs warnings
# to stderr on a machine without a TPU (the CLI promises one summary line there).
COMPILER_DIR_ENV = "SPECJAX_TPU_COMPILER"
DEFAULT_COMPILER_DIR = ROOT / ".venv" / "tpu-compiler"

MiB = 2**20
# The TPU generations we compile for, with the VMEM per core the compiler reports for them.
TARGETS = {"v4:2x2x1": 16 * MiB, "v5e:2x2": 128 * MiB, "v6e:2x2": 128 * MiB,
           "v5p:2x2x1": 64 * MiB}
KERNEL_PREFIXES = ("verify_attention_tpu_split", "verify_attention_tpu_combine")
# The kernels of attn_impl="fused", counted apart (an attn_impl="kernel" program has none).
FUSED_PREFIXES = ("fused_linear_tpu", "ordered_attention_tpu")
# The kernels whose VMEM the compiler's reports are read for (_read_vmem_reports).
VMEM_PREFIXES = KERNEL_PREFIXES + ("ordered_attention_tpu",)


# ----------------------------------------------------------------------------- parent side


def tpu_requirements() -> dict[str, str]:
    """{"jax": version, "libtpu": version} pinned by the ``tpu`` extra in pyproject.toml."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["tpu"]
    pins = {}
    for requirement in extra:
        name, _, version = requirement.partition("==")
        pins[name.split("[")[0].strip()] = version.strip()
    return pins


def find_compiler() -> tuple[str | None, str]:
    """(a PYTHONPATH entry holding libtpu, or "" when the environment has it; None when
    absent, with the reason)."""
    candidates = [os.environ.get(COMPILER_DIR_ENV), str(DEFAULT_COMPILER_DIR)]
    for path in filter(None, candidates):
        if (Path(path) / "libtpu" / "libtpu.so").is_file():
            return path, ""
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:
        return "", ""
    return None, (f"libtpu (the TPU compiler) is not installed: `make tpu-compiler` puts the "
                  f"pinned one in {DEFAULT_COMPILER_DIR.relative_to(ROOT)} (or set "
                  f"{COMPILER_DIR_ENV}); `make test-tpu` installs it and runs these tests")


def run_worker(jobs: list[dict], *, vmem_report: bool = False, timeout: float = 1800
               ) -> list[dict]:
    """Runs ``jobs`` in one subprocess (``JAX_PLATFORMS=cpu``, libtpu on the path).

    Raises:
      RuntimeError: libtpu is missing, or the worker died (its output tail is included).
    """
    path, reason = find_compiler()
    if path is None:
        raise RuntimeError(reason)
    # Only compiling: no TPU is touched, so the lock libtpu takes against a second process
    # using the same TPU (/tmp/libtpu_lockfile) would only make concurrent runs (two
    # checkouts, CI beside a developer) fail with "ABORTED ... libtpu multi-process lockfile".
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    return run_jobs(Path(__file__), jobs, env, ["--vmem-report"] if vmem_report else [],
                    timeout=timeout, what="TPU compile worker")


def run_jobs(script: Path, jobs: list[dict], env: dict, extra_args=(), *,
             timeout: float = 1800, what: str = "compile worker") -> list[dict]:
    """Runs ``script JOBS.json OUT.json *extra_args`` in a subprocess with ``env`` and
    returns its records (the TPU and GPU compile workers' shared parent side).

    Raises:
      RuntimeError: the worker died or wrote nothing (its output tail is included).
    """
    with tempfile.TemporaryDirectory(prefix="specjax-aot-") as tmp:
        jobs_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        jobs_file.write_text(json.dumps(jobs))
        command = [sys.executable, str(script), str(jobs_file), str(out_file), *extra_args]
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0 or not out_file.is_file():
            tail = (done.stdout + done.stderr)[-4000:]
            raise RuntimeError(f"{what} failed (status {done.returncode}):\n{tail}")
        return json.loads(out_file.read_text())


# ----------------------------------------------------------------------------- worker side


def _sharding(target: str):
    import jax
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(topology_name=target, platform="tpu")
    return jax.sharding.SingleDeviceSharding(topology.devices[0])


def _abstract(tree, sharding):
    """Every array leaf as a ``ShapeDtypeStruct`` placed on the target device."""
    import jax
    import numpy as np

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                        tree)


def kernel_args(job: dict, sharding):
    """Abstract arguments of ``verify_attention_tpu`` for a kernel job.

    Job keys: num_heads (H), num_kv_heads (K), head_dim (D), tokens (T), dtype, window (M
    scratch slots, 0 for none), capacity (S cache slots, 0 for no cache: a prefill).
    """
    import jax
    import jax.numpy as jnp

    t, h, k, d = job["tokens"], job["num_heads"], job["num_kv_heads"], job["head_dim"]
    dtype, s, m = jnp.dtype(job["dtype"]), job["capacity"], job["window"]
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    cache = (sds((s, k, d), dtype), sds((s, k, d), dtype)) if s else (None, None)
    return (sds((t, h, d), dtype), sds((t, k, d), dtype), sds((t, k, d), dtype), *cache,
            sds((), jnp.int32), sds((t, t), jnp.bool_),
            sds((t, m), jnp.bool_) if (m and s) else None)


def kernel_options(job: dict, sharding) -> dict:
    """Keyword arguments of ``verify_attention_tpu`` for a kernel job: optional keys
    ``softcap`` (static float) and ``windowed`` (a traced int32 [T] ``first_visible``,
    Gemma-style soft-capping and sliding windows)."""
    import jax
    import jax.numpy as jnp

    options = {}
    if job.get("softcap") is not None:
        options["softcap"] = float(job["softcap"])
    if job.get("windowed"):
        options["first_visible"] = jax.ShapeDtypeStruct((job["tokens"],), jnp.int32,
                                                        sharding=sharding)
    return options


def kernel_estimate(job: dict) -> dict:
    """The kernel's own plan for the job's shapes: tiling and estimated VMEM per kernel."""
    from specjax.kernels import attention_tpu

    q, k_new, _, k_cache, _, _, _, scratch_mask = kernel_args(job, None)
    plan = attention_tpu.vmem_plan(q, k_new, scratch_mask, k_cache is not None,
                                   windowed=bool(job.get("windowed")) and k_cache is not None)
    return dict(dataclasses.asdict(plan), estimate=plan.estimate)


# Small configs of the families on the llama forward with their real features (Hugging
# Face config keys; the published head sizes, query-to-KV grouping, windows, norms, RoPE
# variants and heads' features, few layers). What no kernel reads is cut down, since it
# sets most of a TPU compile's time: fewer heads of the published size and grouping (so a
# narrower model), MLPs (and experts) at most 1,024 wide, vocabularies of 32,000 (Phi-3's
# own 32,064, not a multiple of 128, stays). The kernels' VMEM at the published head
# counts is what test_tpu_compile's kernel shapes check. An `ar` program's compile for the
# TPU on the 2-core CPU, 2026-11-29: Mixtral's for v5e 162 s of CPU at its 14,336-wide
# experts, 68 s at an eighth; Gemma 2's for v6e 27.9 s at its published 256,000 x 2,304,
# 16.7 s at 32,000 x 1,024; alone, wall (CPU) seconds: Phi-3's for v6e 18.4 (32.8) with its
# 32 heads, 9.3 (15.2) with 8; GPT-NeoX's for v6e 25.2 (43.3) with 16, 16.3 (25.9) with 8.
FAMILY_HF_CONFIGS = {
    # Qwen3-0.6B's heads (of 16 / 8: here 8 / 4, of 128) and q/k norms, 4 layers.
    "qwen3": dict(model_type="qwen3", vocab_size=32000, hidden_size=1024,
                  intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1000000.0, tie_word_embeddings=True),
    # Gemma-2-2B's heads (8 / 4 of 256), soft-capping, alternating 4096-token windows.
    "gemma2": dict(model_type="gemma2", vocab_size=32000, hidden_size=1024,
                   intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   query_pre_attn_scalar=256, sliding_window=4096,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    # Gemma-3-270M: 4 / 1 heads of 256, q/k norms, five 512-token sliding layers per global
    # one, local and global RoPE bases.
    "gemma3": dict(model_type="gemma3_text", vocab_size=32000, hidden_size=640,
                   intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                   query_pre_attn_scalar=256, sliding_window=512, rope_theta=1000000.0,
                   rope_local_base_freq=10000.0),
    # Phi-3-mini-4k: heads of 96 (8 of its 32, each with its own KV head), a 2047-token
    # window in every layer, untied head.
    "phi3": dict(model_type="phi3", vocab_size=32064, hidden_size=768,
                 intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8, max_position_embeddings=4096, sliding_window=2047,
                 tie_word_embeddings=False),
    # SmolLM3-3B's heads (of 16 / 4: here 8 / 2, of 128), every fourth layer without RoPE,
    # tied head.
    "smollm3": dict(model_type="smollm3", vocab_size=32000, hidden_size=1024,
                    intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, max_position_embeddings=65536,
                    rope_theta=5000000.0, no_rope_layer_interval=4, tie_word_embeddings=True),
    # Phi-4-mini: heads of 128 (of 24 / 8: here 6 / 2) with RoPE on the first 96 dims
    # (partial rotary), LongRoPE over a 4096-token pretraining length, a tied head.
    "phi4-mini": dict(model_type="phi3", vocab_size=32000, hidden_size=768,
                      intermediate_size=1024, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=131072,
                      original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                      rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                                    "long_factor": [1.0 + i / 8 for i in range(48)]},
                      tie_word_embeddings=True),
    # Phi-3-mini with Phi-2's head size (80; 8 heads): the attention kernels' tiles 128
    # wide over the cache's 80 columns (GPU), blocks ending in the whole 80 (TPU).
    "phi3-head80": dict(model_type="phi3", vocab_size=32064, hidden_size=640,
                        intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=8, max_position_embeddings=4096,
                        sliding_window=2047, tie_word_embeddings=False),
    # The same with heads of 40 (not a multiple of 16), which no attention kernel takes:
    # the programs that run the jnp attention fallback.
    "phi3-head40": dict(model_type="phi3", vocab_size=32064, hidden_size=320,
                        intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=8, max_position_embeddings=4096,
                        sliding_window=2047, tie_word_embeddings=False),
    # OLMo-2-1B's heads (of 16 / 16: here 8 / 8, of 128) and block (output norms only, q/k
    # normed over all heads), with Olmo 3's layout: three 4096-token sliding layers per
    # global one, YaRN (Olmo-3-7B's: factor 8 over 8192 positions) on the global layers only.
    "olmo3": dict(model_type="olmo3", vocab_size=32000, hidden_size=1024,
                  intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, max_position_embeddings=65536, sliding_window=4096,
                  rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                "original_max_position_embeddings": 8192,
                                "attention_factor": 1.2079441541679836}),
    # Pythia-1.4B's heads (of 16: here 8, of 128, RoPE on the first 32 dims), LayerNorm,
    # parallel residual, a two-matrix GELU MLP, biases, an untied head.
    "gpt-neox": dict(model_type="gpt_neox", vocab_size=32000, hidden_size=1024,
                     intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                     max_position_embeddings=2048, rotary_pct=0.25, rotary_emb_base=10000,
                     use_parallel_residual=True, hidden_act="gelu",
                     tie_word_embeddings=False),
    # Mixtral-8x7B's heads (of 32 / 8: here 8 / 2, of 128) and experts (8, two per token).
    "mixtral": dict(model_type="mixtral", vocab_size=32000, hidden_size=1024,
                    intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                    num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
    # Qwen3-30B-A3B's heads (of 32 / 4: here 16 / 2, of 128; q/k norms) and experts (128,
    # eight per token, their probabilities rescaled).
    "qwen3-moe": dict(model_type="qwen3_moe", vocab_size=32000, hidden_size=1024,
                      intermediate_size=1024, moe_intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                      num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                      max_position_embeddings=40960, rope_theta=1e6,
                      tie_word_embeddings=False),
}


# The drafts a program's ``spec``/``tree``/``staged`` can take (:func:`program_configs`).
DRAFTS = ("feature", "token")


def program_configs(method: str, *, family: str | None = None, draft: str | None = None):
    """(target config, draft config or None) of :func:`build_generation_program`'s program.

    The target is SmolLM2-135M's config, or ``family``'s (:data:`FAMILY_HF_CONFIGS`). The
    draft, for ``spec``/``tree``/``staged`` only: ``feature``, the kind shipped for
    SmolLM2-135M, its config read from the shipped ``draft.json`` as the loader reads it
    (an EAGLE-3 feature draft: one block of the target's shapes reading blocks (1, 14, 26)
    of the target, a 12,288-id head of its own); ``token``, the target's first two layers'
    shapes with the full head (the kind shipped before; for a family, its first two layers).
    ``None``: ``feature`` for SmolLM2, ``token`` for a family (none is shipped for one).

    Raises:
      ValueError: an unknown draft, or ``feature`` with a family.
    """
    from specjax import config as config_lib
    from specjax.checkpoints_tools import assets, sources
    from specjax.families import from_hf_config

    config = config_lib.smollm2_135m()
    if family is not None:
        config = from_hf_config(FAMILY_HF_CONFIGS[family])
    if method not in ("spec", "tree", "staged"):
        return config, None
    draft = draft or ("token" if family else "feature")
    if draft not in DRAFTS:
        raise ValueError(f"unknown draft {draft!r}; expected one of {DRAFTS}")
    if draft == "token":
        return config, dataclasses.replace(config, num_layers=2)
    if family is not None:
        raise ValueError(f"no feature draft is shipped for family {family!r}: draft='token'")
    record = json.loads((sources.assets_dir() / "smollm2-135m" / assets.DRAFT_CONFIG)
                        .read_text())
    return config, assets.draft_config(config, record)


def build_generation_program(method: str, *, verify: str | None = None,
                             dtype: str = "bfloat16", prompt_tokens: int = 16,
                             max_new_tokens: int = 64, attn_impl: str = "kernel",
                             fused_projections: bool = False, temperature: float = 0.0,
                             defaults: str = "cpu", family: str | None = None,
                             sampling_rules: str = "auto", gpu_linear: str = "triton",
                             draft: str | None = None):
    """(jitted function, example arguments) of one whole generation, as ``generate`` runs it.

    The target has SmolLM2-135M's shapes (30 layers, 9 query / 3 KV heads of 64) with
    abstract parameters (never materialised); the draft for ``spec``/``tree``/``staged`` is
    by default the kind shipped for it (an EAGLE-3 feature draft: one block reading the
    target's blocks 1, 14 and 26, a 12,288-id head; :func:`program_configs`), with
    ``draft="token"`` two layers of the target's shapes with the full head; ``staged`` uses
    the shipped n-gram tables. The only place that knows how ``specjax.generate``
    assembles its program: adapt it here when the API changes.

    Args:
      method: ``ar``, ``tree``, ``staged`` (or ``spec``, ``ngram``).
      verify: the acceptance rule (``coupled``, ``greedy``, ...); ``None`` for ``ar``.
      dtype: parameter and cache dtype.
      fused_projections: the target's q|k|v and gate|up matrices fused
        (:func:`specjax.models.fuse_projections`), and the draft's (a draft resolved for a
        fused target takes its layout: :func:`specjax.loading.resolve_draft`).
      temperature: the request's (0: greedy). Whether the program holds one sampling rule
        or all of them follows ``sampling_rules`` (``KernelOptions.sampling_rules``,
        :func:`specjax.sampling.static_rules`; the abstract weights are on no device, so
        ``auto`` means traced).
      gpu_linear: ``KernelOptions.gpu_linear`` (the GPU linear kernel's backend).
      defaults: whose method defaults the program takes (``cpu``, ``gpu``, ``tpu``:
        :data:`specjax.methods.options.BACKEND_DEFAULTS`). The abstract weights are on no
        device, so ``generate`` itself would take the CPU's.
      family: a :data:`FAMILY_HF_CONFIGS` name: that config for the target (and the first
        two of its layers for the draft) instead of SmolLM2's, without shipped assets.
      draft: ``feature`` or ``token`` (:func:`program_configs`); ``None``: the shipped
        kind, ``feature`` (``token`` for a family).
    Returns:
      (fn, args): ``fn(*args)`` is the program; args hold concrete small arrays and
      ``ShapeDtypeStruct`` parameters (map them to the target with :func:`_abstract`).
    """
    import jax
    import jax.numpy as jnp

    from specjax import api, decode, methods, models
    from specjax.loaded_model import Model

    key = jax.random.key(0)
    config, draft_config = program_configs(method, family=family, draft=draft)

    def abstract_model(cfg, name, assets=None, fused=False):
        def init():
            params = models.init_params(cfg, key, jnp.dtype(dtype))
            return models.fuse_projections(cfg, params) if fused else params
        return Model(config=cfg, params=jax.eval_shape(init), name=name, assets=assets)

    target = abstract_model(config, family or "smollm2-135m-shaped",
                            assets=None if family else "smollm2-135m",
                            fused=fused_projections)
    draft_model = None
    if draft_config is not None:
        name = (f"draft-{draft_config.num_layers}-layers"
                + ("-feature" if draft_config.feature_input else ""))
        draft_model = abstract_model(draft_config, name, fused=fused_projections)
    method = methods.method_options(method, backend=defaults)
    if verify is not None:  # in the options object: a keyword beside it may not differ
        method = dataclasses.replace(method, verify=verify)
    # The abstract model's backend is the CPU's (no device holds its weights); the
    # method's options are the accelerator's (``defaults``), resolved above.
    request = api._prepare(target, list(range(1, prompt_tokens + 1)), api.request(
        method=method, max_new_tokens=max_new_tokens, temperature=temperature,
        draft=draft_model, assets=target.assets, kernels=api.KernelOptions(
            attention=attn_impl, sampling_rules=sampling_rules, gpu_linear=gpu_linear)))
    loop = request.loop
    fn = jax.jit(lambda params, *rest: decode.run_to_completion(params, loop, *rest))
    return fn, request.args


def fused_kernel_calls(job: dict, sharding):
    """(jitted function, abstract arguments): every ``attn_impl="fused"`` kernel call of one
    SmolLM2-135M layer and its head at ``job["tokens"]`` rows (bfloat16): the fused q|k|v
    matrix whole and its k range alone (RMSNorm folded in), o (+ residual), gate|up SwiGLU, down
    (+ residual), the tied head (float32 logits) and the position-ordered attention over a
    stacked 2048-slot cache, each read at a traced layer."""
    import jax
    import jax.numpy as jnp

    from specjax import config as config_lib
    from specjax.kernels.attention_ordered_tpu import ordered_attention_tpu
    from specjax.kernels.linear_tpu import fused_linear_tpu

    c = config_lib.smollm2_135m()
    t, d, f, layers = job["tokens"], c.hidden_size, c.intermediate_size, c.num_layers
    q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    dtype = jnp.dtype(job.get("dtype", "bfloat16"))
    sds = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    args = dict(x=sds((t, d)), w_qkv=sds((layers, d, q_width + 2 * kv_width)),
                attn_norm=sds((layers, d)), w_o=sds((layers, q_width, d)),
                w_gate_up=sds((layers, d, 2 * f)), mlp_norm=sds((layers, d)),
                w_down=sds((layers, f, d)), embed=sds((c.vocab_size, d)), final_norm=sds((d,)),
                q=sds((t, c.num_heads, c.head_dim)), k=sds((t, c.num_kv_heads, c.head_dim)),
                cache=sds((layers, 2048, c.num_kv_heads, c.head_dim)),
                length=sds((), jnp.int32), mask=sds((t, t), jnp.bool_),
                layer=sds((), jnp.int32))

    def calls(a):
        x, layer = a["x"], a["layer"]
        # The whole q|k|v matrix (what the model calls), and one range no 128-lane block
        # can start at (k, column 576: the full-width block cut in the epilogue).
        qkv = [fused_linear_tpu(x, (a["w_qkv"],), norm=a["attn_norm"], layer=layer,
                                offsets=(offset,), width=width)
               for offset, width in ((0, q_width + 2 * kv_width), (q_width, kv_width))]
        attention = ordered_attention_tpu(a["q"], a["k"], a["k"], a["cache"], a["cache"],
                                          a["length"], a["mask"], layer=layer)
        o = fused_linear_tpu(attention.reshape(t, q_width), (a["w_o"],), residual=x,
                             layer=layer)
        h = fused_linear_tpu(o, (a["w_gate_up"],) * 2, norm=a["mlp_norm"], layer=layer,
                             offsets=(0, f), width=f)
        down = fused_linear_tpu(h, (a["w_down"],), residual=o, layer=layer)
        logits = fused_linear_tpu(down, (a["embed"],), norm=a["final_norm"], transposed=True,
                                  float32_out=True)
        return (*qkv, logits)

    return jax.jit(calls), (args,)


def canary(job: dict, sharding):
    """A kernel Mosaic must reject in bfloat16: a middle-axis load at a *dynamic* index
    (E2003, unprovable alignment). It compiles in float32. Proves errors reach us."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(index_ref, x_ref, o_ref):
        o_ref[...] = x_ref[:, index_ref[0], :].astype(jnp.float32)

    from jax.experimental.pallas import tpu as pltpu

    call = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((256, 128), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec((256, 8, 128), lambda i, index: (0, 0, 0))],
            out_specs=pl.BlockSpec((256, 128), lambda i, index: (0, 0))))
    dtype = jnp.dtype(job["dtype"])
    args = (jax.ShapeDtypeStruct((1,), jnp.int32, sharding=sharding),
            jax.ShapeDtypeStruct((256, 8, 128), dtype, sharding=sharding))
    return jax.jit(call), args


def _read_vmem_reports(folder: str) -> tuple[dict[str, int], int | None]:
    """({kernel name prefix: the most VMEM bytes any instance got}, VMEM capacity) from the
    VMEM reports libtpu dumped into ``folder`` since the last call (then deleted)."""
    used: dict[str, int] = {}
    capacity = None
    for path in glob.glob(os.path.join(folder, "*vmem_report*")):
        text = Path(path).read_text()
        start = text.index("const DATA =") + len("const DATA =")
        data, _ = json.JSONDecoder().raw_decode(text[start:].lstrip())
        capacity = int(data["global_info"]["vmem_capacity"])
        for name, entry in data["hlo_breakdowns"].items():
            for prefix in VMEM_PREFIXES:
                if name.startswith(prefix):
                    # What the kernel allocates: its windows, scratch, Mosaic's internal
                    # scratch and register spills (inside a larger program XLA may also
                    # reserve a scoped region around the kernel; that is not counted).
                    size = sum(int(a["size"]) for block in entry["blocks"]
                               for a in block["allocations"])
                    used[prefix] = max(used.get(prefix, 0), size)
    for path in glob.glob(os.path.join(folder, "*")):
        os.remove(path)
    return used, capacity


def _large_copies(text: str, min_elements: int = 2**20) -> list[str]:
    """Copies and transposes of at least ``min_elements`` elements in compiled HLO text,
    marked ``(in loop)`` when they sit in a while loop's body or in what it calls: memory
    traffic the compile succeeds with (a relayout of the weights or of the KV cache, a
    loop carrying a copy) that a TPU would pay once per call, or once per step in a loop."""
    computation, calls, copies, bodies = None, {}, [], set()
    pattern = r"= \(?(\w+)\[([\d,]+)\]\{[^}]*\}[^=]*? (copy-start|copy|transpose)\("
    for line in text.splitlines():
        header = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            computation = header.group(1)
            calls[computation] = set()
            continue
        if computation is None:
            continue
        calls[computation].update(re.findall(
            r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line))
        if "branch_computations={" in line:
            branches = line.split("branch_computations={")[1].split("}")[0]
            calls[computation].update(re.findall(r"%?([\w.\-]+)", branches))
        bodies.update(re.findall(r"body=%?([\w.\-]+)", line))
        match = re.search(pattern, line)
        if match and math.prod(int(d) for d in match.group(2).split(",")) >= min_elements:
            copies.append((computation, f"{match.group(3)} {match.group(1)}[{match.group(2)}]"))
    in_loop, frontier = set(), list(bodies)
    while frontier:
        name = frontier.pop()
        if name not in in_loop:
            in_loop.add(name)
            frontier.extend(calls.get(name, ()))
    return [f"{copy} (in loop)" if where in in_loop else copy for where, copy in copies]


def _compile_kernels_for_tpu() -> None:
    """Makes ``attn_impl="kernel"`` pick the TPU kernel, compiled (not interpreted).

    The kernel dispatcher (:func:`specjax.kernels.select_variant`) chooses from
    ``jax.default_backend()``, which is the CPU in this process although the program is
    compiled for a TPU; on a TPU backend it returns exactly this.
    """
    from specjax import kernels

    kernels.select_variant = lambda variant=None, interpret_variant="gpu": ("tpu", False)


def compile_timed(lowered, record: dict):
    """``lowered.compile()``, its wall and CPU seconds put in ``record`` (the CPU seconds of
    every thread: on a shared machine wall time also measures the others)."""
    start, cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    record["compile_s"] = round(time.perf_counter() - start, 3)
    record["compile_cpu_s"] = round(time.process_time() - cpu, 3)
    return compiled


def run_job(job: dict, dump_dir: str | None) -> dict:
    """Lowers and compiles one job for its target; never raises.

    Jobs: ``{"kind": "kernel", "target", **kernel_args and kernel_options keys}``,
    ``{"kind": "program", "target", "method", "verify", "dtype", "attn_impl", "family",
    "draft"}`` (:func:`build_generation_program`),
    ``{"kind": "fused_kernels", "target", "tokens"}`` (:func:`fused_kernel_calls`),
    ``{"kind": "ordered_kernel", ...}`` (the position-ordered attention kernel with a kernel
    job's keys, no scratch window; the record adds its ``block_kv`` and VMEM estimate),
    ``{"kind": "canary", "target", "dtype"}``; a kernel job may set ``vmem_limit_bytes``.
    """
    import jax

    record = dict(job, ok=False, error=None)
    try:
        sharding = _sharding(job["target"])
        if job["kind"] == "kernel":
            from specjax.kernels import TpuBlockSizes, verify_attention_tpu

            record.update(kernel_estimate(job))
            fn = verify_attention_tpu
            options = kernel_options(job, sharding)
            if job.get("vmem_limit_bytes"):
                options["block_sizes"] = TpuBlockSizes(vmem_limit_bytes=job["vmem_limit_bytes"])
            args = kernel_args(job, sharding)
            start = time.perf_counter()
            lowered = fn.lower(*args, **options)
        elif job["kind"] == "program":
            _compile_kernels_for_tpu()
            fn, args = build_generation_program(job["method"], verify=job.get("verify"),
                                                dtype=job.get("dtype", "bfloat16"),
                                                attn_impl=job.get("attn_impl", "kernel"),
                                                family=job.get("family"),
                                                draft=job.get("draft"))
            start = time.perf_counter()
            lowered = fn.lower(*_abstract(args, sharding))
        elif job["kind"] == "fused_kernels":
            fn, args = fused_kernel_calls(job, sharding)
            start = time.perf_counter()
            lowered = fn.lower(*args)
        elif job["kind"] == "ordered_kernel":
            from specjax.kernels import attention_ordered_tpu as ordered

            args, options = kernel_args(job, sharding), kernel_options(job, sharding)
            if "block_rows" in job or "block_kv" in job:  # a tiling probe
                options["block_sizes"] = ordered.TpuOrderedBlockSizes(
                    block_rows=job.get("block_rows", 8), block_kv=job.get("block_kv"))
            record["block_rows"], record["block_kv"] = ordered.check_supported(
                *args[:5], *args[6:], **options)
            record["estimate"] = ordered.vmem_bytes(
                record["block_rows"], record["block_kv"], job["num_kv_heads"],
                job["head_dim"], jax.numpy.dtype(job["dtype"]).itemsize,
                windowed="first_visible" in options)
            start = time.perf_counter()
            lowered = ordered.ordered_attention_tpu.lower(*args, **options)
        elif job["kind"] == "canary":
            fn, args = canary(job, sharding)
            start = time.perf_counter()
            lowered = fn.lower(*args)
        else:
            raise ValueError(f"unknown job kind {job['kind']!r}")
        record["lower_s"] = round(time.perf_counter() - start, 3)
        compiled = compile_timed(lowered, record)
        # Mosaic kernels in the compiled program, by name (a program with attn_impl="kernel"
        # must contain the TPU kernels, not the CPU fallback or an interpreted kernel).
        text = compiled.as_text()
        record["tpu_kernels"] = {prefix: text.count(prefix) for prefix in KERNEL_PREFIXES}
        record["fused_kernels"] = {prefix: text.count(prefix) for prefix in FUSED_PREFIXES}
        record["large_copies"] = _large_copies(text)
        record["ok"] = True
    except Exception as error:  # noqa: BLE001 -- the record carries it to the test
        record["error"] = f"{type(error).__name__}: {error}"
        if not isinstance(error, jax.errors.JaxRuntimeError):
            record["traceback"] = traceback.format_exc()[-3000:]
    if dump_dir is not None:
        record["vmem_used"], record["vmem_capacity"] = _read_vmem_reports(dump_dir)
    return record


def main(argv: list[str]) -> int:
    if argv == ["--requirement"]:  # for `make tpu-compiler`
        print(f"libtpu=={tpu_requirements()['libtpu']}")
        return 0
    jobs_file, out_file = argv[:2]
    dump_dir = None
    if "--vmem-report" in argv:
        # libtpu reads its flags once, when the TPU backend starts: set them before that.
        # Dump only the VMEM report (a JSON table per compiled module, per HLO op).
        dump_dir = tempfile.mkdtemp(prefix="specjax-vmem-")
        flags = (f"--xla_jf_dump_to={dump_dir} "
                 "--xla_jf_dump_llo_pass_label_regex=^vmem_report$")
        os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {flags}"
    import jax
    import importlib.metadata

    versions = {"jax": jax.__version__, "libtpu": importlib.metadata.version("libtpu")}
    pins = tpu_requirements()
    if versions != {"jax": pins["jax"], "libtpu": pins["libtpu"]}:
        # A libtpu is built for one jax/jaxlib; another pairing may fail in obscure ways.
        print(f"installed: jax {versions['jax']}, libtpu {versions['libtpu']}; the tpu extra "
              f"pins jax {pins['jax']} with libtpu {pins['libtpu']}: install the pinned pair "
              "(make tpu-compiler) or update the pins together", file=sys.stderr)
        return 3
    records = []
    try:
        for job in json.loads(Path(jobs_file).read_text()):
            record = run_job(job, dump_dir)
            record["versions"] = versions
            records.append(record)
            print(json.dumps({k: record.get(k) for k in ("kind", "target", "ok", "compile_s")}),
                  flush=True)
    finally:
        if dump_dir is not None:
            shutil.rmtree(dump_dir, ignore_errors=True)
    Path(out_file).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
