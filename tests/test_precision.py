"""float32 means float32: every float32 matmul states ``Precision.HIGHEST`` itself.

On a GPU, XLA and Triton run float32 dots in TF32 by default; then a verify pass and a
one-token step round differently and speculative output can leave ``ar``'s at a near-tie
(measured on an H100). ``tests/conftest.py`` sets ``jax_default_matmul_precision=highest``
for the whole suite, which would hide a matmul that does not set its precision, so these
checks lower the programs in a fresh interpreter without that setting and read the
precision of every ``dot_general`` in the StableHLO text: float32 operands must carry
``HIGHEST``, bfloat16 operands must not (they keep the tensor-core default).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowers, in this fresh process (default matmul precision), the forward passes the decode
# step runs, and prints one JSON record per dot_general: operand element types, precision.
PROBE = r"""
import json, sys
import jax, jax.numpy as jnp
assert jax.config.jax_default_matmul_precision is None, "the probe must run with the default"
from specjax import models
from specjax.cache import init_cache
from specjax.config import ModelConfig

config = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                     max_position_embeddings=256)
tokens = jnp.arange(4, dtype=jnp.int32)
mask = jnp.tril(jnp.ones((4, 4), bool))

for dtype_name, impl in (arg.split(":") for arg in sys.argv[1:]):
    dtype = jnp.dtype(dtype_name)
    params = models.init_params(config, jax.random.PRNGKey(0), dtype)
    cache = init_cache(config, 64, dtype)

    def step(params, tokens, cache):
        return models.forward(params, config, tokens, tokens + cache.length, cache, mask,
                              jnp.ones((4, 2), bool), attn_impl=impl)

    text = jax.jit(step).lower(params, tokens, cache).as_text()
    for line in text.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        precision = __import__("re").search(r"precision = \[(\w+), (\w+)\]", line)
        types = __import__("re").findall(r"tensor<[0-9x]*x?(f32|bf16|f16)>",
                                         line.split(" : ")[-1])
        print(json.dumps({"program": f"{dtype_name}:{impl}", "operands": types[:2],
                          "precision": list(precision.groups()) if precision else None}))
"""


IMPLS = ("reference", "auto", "kernel")
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def dots() -> dict[tuple[str, str], list[dict]]:
    """Every (dtype, attn_impl) program's dots, lowered in one fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_DEFAULT_MATMUL_PRECISION"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    programs = [f"{dtype}:{impl}" for dtype in DTYPES for impl in IMPLS]
    out = subprocess.run([sys.executable, "-c", PROBE, *programs], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = {tuple(program.split(":")): [] for program in programs}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            found[tuple(record.pop("program").split(":"))].append(record)
    return found


@pytest.mark.parametrize("impl", IMPLS)
def test_float32_dots_are_highest_and_bfloat16_dots_are_not(dots, impl):
    """``kernel`` lowers the Pallas GPU kernel in interpret mode: its dots count too."""
    for dtype in DTYPES:
        found = dots[dtype, impl]
        # q, k, v, o, gate, up, down (once: the layers are a loop), the head and at least
        # two attention products.
        assert len(found) >= 7 + 1 + 2, (dtype, impl, found)
        for dot in found:
            assert dot["precision"] is not None, (dtype, impl, dot)
            if "f32" in dot["operands"]:
                assert dot["precision"] == ["HIGHEST", "HIGHEST"], (dtype, impl, dot)
            else:
                assert "HIGHEST" not in dot["precision"], (dtype, impl, dot)
        operand_types = {t for dot in found for t in dot["operands"]}
        # The bfloat16 model's projections really are bfloat16 dots (checked above to run at
        # the default precision), and the float32 model has no narrower dot at all.
        assert ("bf16" in operand_types) == (dtype == "bfloat16"), (dtype, impl, operand_types)


def test_the_probe_sees_an_unstated_precision():
    """The probe is sharp: a float32 dot without a stated precision shows as DEFAULT."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_DEFAULT_MATMUL_PRECISION"}
    env["JAX_PLATFORMS"] = "cpu"
    code = ("import jax, jax.numpy as jnp\n"
            "print(jax.jit(lambda a: a @ a).lower(jnp.ones((2, 2))).as_text())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert re.search(r"dot_general.*precision = \[DEFAULT, DEFAULT\].*xf32", out.stdout)
