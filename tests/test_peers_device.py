"""Where the transformers peers run: on the GPU (bf16) whenever torch sees one, else on the
CPU (fp32), and the JSON says which and why. (On an H100 machine they used to run on the
CPU: the choice also required JAX to run on the GPU.)"""

from __future__ import annotations

import jax
import pytest
import torch

from specjax.harness import peers


def test_cuda_when_torch_sees_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    assert jax.default_backend() == "cpu"  # whatever JAX runs on
    device, dtype, reason = peers.choose_device(torch)
    assert (device, dtype) == ("cuda", "bfloat16") and "H100" in reason


@pytest.mark.parametrize("build,why", [(None, "CPU-only torch build"),
                                       ("12.4", "built for CUDA 12.4 sees no GPU")])
def test_cpu_otherwise_with_the_reason(monkeypatch, build, why):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", build)
    device, dtype, reason = peers.choose_device(torch)
    assert (device, dtype) == ("cpu", "float32") and why in reason


def test_the_peers_record_their_device(monkeypatch):
    """The device choice reaches the peers object and what the JSON records, before any
    model is loaded (a failed load must not hide where the peers would have run)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "GPU-X")

    def no_load(self, model):
        raise RuntimeError("not loading in this test")

    monkeypatch.setattr(peers.TransformersPeers, "_load", no_load)
    group = peers.TransformersPeers(["hf"], target=object())
    described = group.describe()
    assert described["device"] == "cuda" and described["dtype"] == "bfloat16"
    assert "GPU-X" in described["device_reason"]
    assert described["jax_backend"] == jax.default_backend()
    assert described["peers"]["hf"]["status"] == "unavailable"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peers.TransformersPeers(["hf"], target=object()).describe()["device"] == "cpu"


def test_a_model_with_fused_projections_exports_in_the_checkpoint_layout(monkeypatch):
    """The peers write our weights as a Hugging Face directory: a target running with fused
    q|k|v and gate|up weights is written with the separate ones, which transformers loads."""
    import numpy as np

    from conftest import tiny_pair
    from specjax import models

    hf_model, model = tiny_pair("llama-gqa", seed=4)
    fused = dataclasses_replace(model, models.fuse_projections(model.config, model.params))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    group = peers.TransformersPeers(["hf"], target=fused)
    assert group.available("hf"), group.describe()
    loaded = group._models["target"].state_dict()
    expected = hf_model.state_dict()
    name = "model.layers.0.self_attn.k_proj.weight"
    np.testing.assert_array_equal(loaded[name].numpy(), expected[name].numpy())


def dataclasses_replace(model, params):
    import dataclasses

    return dataclasses.replace(model, params=params)
