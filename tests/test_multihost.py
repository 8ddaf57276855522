"""Two processes on localhost, 4 simulated CPU devices each, one global 8-device mesh.

Each process runs this file as a script (``python tests/test_multihost.py PORT RANK``):
it calls :func:`jax.distributed.initialize` (CPU collectives over gloo), builds the same
tiny random models as ``tests/test_sharding.py``, places them on a mesh over all 8
devices with :func:`specjax.sharding.shard_model`, runs the same :func:`specjax.generate`
calls as the other process, and prints the tokens as one JSON line. The test checks that
both processes got the tokens a single process on one device gets, for:

* ``model=8``, ``ar``: tensor parallel across both processes (each all-reduce crosses
  them);
* ``data=2 x model=4``: tensor parallel inside each process, one row of the mesh each,
  for ``tree`` (batch 1) and ``ar`` over a batch of 4 prompts (split by row over the
  processes);

each greedy and with coupled sampling (temperature 1, one seed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

PROCESSES = 2
LOCAL_DEVICES = 4
NEW_TOKENS = 8
TIMEOUT_S = 420
TEMPERATURES = (0.0, 1.0)
# (name, mesh (data, model), method)
CASES = [("ar-tp8", (1, 8), "ar"),
         ("tree-dp2-tp4", (2, 4), "tree"), ("batch-ar-dp2-tp4", (2, 4), "batch-ar")]
TREE = dict(tree_budget=6, draft_depth=2, draft_width=2)


def _prompts():
    import numpy as np

    prompt = np.random.default_rng(0).integers(0, 97, 7).tolist()
    batch = [np.random.default_rng(s).integers(0, 97, 2 + 3 * s).tolist() for s in range(4)]
    return prompt, batch


def _generate(model, draft, kind: str, temperature: float):
    import specjax

    prompt, batch = _prompts()
    method = kind.removeprefix("batch-")
    options = dict(TREE, draft=draft) if method == "tree" else {}
    out = specjax.generate(model, batch if kind.startswith("batch-") else prompt,
                           max_new_tokens=NEW_TOKENS, method=method, temperature=temperature,
                           seed=3, **options)
    return [o.tokens for o in out] if isinstance(out, list) else out.tokens


def _worker(port: int, rank: int) -> dict:
    """One process of the pair (run as a script)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=PROCESSES, process_id=rank,
                               initialization_timeout=120)
    from specjax import sharding
    from test_sharding import _models

    assert jax.process_count() == PROCESSES and len(jax.local_devices()) == LOCAL_DEVICES
    assert len(jax.devices()) == PROCESSES * LOCAL_DEVICES
    target, draft, *_ = _models()
    report = {"process": jax.process_index(), "devices": len(jax.devices()), "cases": {}}
    for name, (data, model_size), kind in CASES:
        start = time.perf_counter()
        mesh = sharding.make_mesh(data=data, model=model_size)  # every process's devices
        sharded = sharding.shard_model(target, mesh)
        sharded_draft = sharding.shard_model(draft, mesh)
        report["cases"][name] = {str(t): _generate(sharded, sharded_draft, kind, t)
                                 for t in TEMPERATURES}
        print(f"process {rank}: {name} {time.perf_counter() - start:.1f} s", file=sys.stderr,
              flush=True)
    jax.distributed.shutdown()
    return report


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _run_pair() -> list[dict]:
    from conftest import fast_xla_flags  # the test process only (it loads torch)

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES} "
                         f"{fast_xla_flags()}")  # compiles faster
    port = _free_port()
    workers = [subprocess.Popen([sys.executable, __file__, str(port), str(rank)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for rank in range(PROCESSES)]
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    for worker in workers:
        try:
            outputs.append(worker.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in workers:
                other.kill()
            outputs.append(worker.communicate())
    failed = [rank for rank, worker in enumerate(workers) if worker.returncode != 0]
    if failed or len(outputs) != PROCESSES:
        tails = "\n".join(f"--- process {rank} (exit {workers[rank].returncode}) stderr:\n"
                          f"{outputs[rank][1][-4000:]}" for rank in range(len(outputs)))
        pytest.fail(f"multi-process run failed (port {port}, timeout {TIMEOUT_S} s):\n{tails}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@pytest.fixture(scope="module")
def reports():
    start = time.perf_counter()
    result = _run_pair()
    print(f"two processes: {time.perf_counter() - start:.1f} s")
    return result


@pytest.fixture(scope="module")
def single_process():
    """The same calls in this process, on its one device."""
    from test_sharding import _models

    target, draft, *_ = _models()
    return {kind: {str(t): _generate(target, draft, kind, t) for t in TEMPERATURES}
            for kind in {kind for _, _, kind in CASES}}


def test_both_processes_see_one_global_mesh(reports):
    assert [r["process"] for r in reports] == list(range(PROCESSES))
    assert {r["devices"] for r in reports} == {PROCESSES * LOCAL_DEVICES}


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_multi_process_tokens_equal_single_process(reports, single_process, case):
    kind = dict((c[0], c[2]) for c in CASES)[case]
    for temperature in map(str, TEMPERATURES):
        expected = single_process[kind][temperature]
        assert len(expected) == (4 if kind.startswith("batch-") else NEW_TOKENS)
        for report in reports:
            assert report["cases"][case][temperature] == expected, (
                case, temperature, report["process"])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(_worker(int(sys.argv[1]), int(sys.argv[2]))))
