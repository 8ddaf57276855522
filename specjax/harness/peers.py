"""Peers: transformers (PyTorch) ``generate()`` on the same weights, in the same process.

Three peers, each a name on the command line:

* ``hf``: plain ``generate()`` (greedy at temperature 0, ``do_sample`` otherwise);
* ``hf-assisted``: ``generate(assistant_model=draft)``, transformers' speculative
  decoding with the same draft as ours (exported to a Hugging Face directory);
* ``hf-lookup``: ``generate(prompt_lookup_num_tokens=...)``, prompt-lookup decoding.

The target and draft are written with
:func:`specjax.checkpoints_tools.hf.save_hf_directory` from *our* parameters (in float32)
and loaded with ``AutoModelForCausalLM``, so both sides compute with the same weights
whatever the source checkpoint (GGUF, HF, orbax). PyTorch runs on the GPU in bfloat16
whenever it sees one (``torch.cuda.is_available()``), else on the CPU in float32
(:func:`choose_device`); the JSON records where and why (a CPU-only torch build on a GPU
machine shows up there, instead of silently comparing a GPU with a CPU). Stop tokens are disabled on both sides: every system
generates exactly ``max_new_tokens`` tokens. At temperature > 0 transformers samples with
its own random numbers: its tokens are not expected to equal ours.

A peer that cannot run (torch missing, no draft for ``hf-assisted``, an export or load
failure) is reported with the reason instead of stopping the run.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Sequence

import jax
import numpy as np

from specjax import models
from specjax.checkpoints_tools.hf import save_hf_directory
from specjax.errors import InvalidArgumentError

PEERS = ("hf", "hf-assisted", "hf-lookup")
PROMPT_LOOKUP_NUM_TOKENS = 10


def parse_peers(spec: str) -> list[str]:
    """``"none"`` -> [], ``"all"`` -> every peer, else a comma-separated subset of
    :data:`PEERS`."""
    spec = spec.strip()
    if spec == "none":
        return []
    if spec == "all":
        return list(PEERS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise InvalidArgumentError(
            f"unknown peer {unknown[0] if unknown else spec!r}; expected none, all, or a "
            f"comma-separated subset of {', '.join(PEERS)}")
    return list(dict.fromkeys(names))


def choose_device(torch) -> tuple[str, str, str]:
    """(device, dtype, reason) for the transformers peers: ``cuda``/``bfloat16`` when torch
    sees a CUDA GPU, else ``cpu``/``float32`` (the reason says which torch build and why)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return "cuda", "bfloat16", f"torch.cuda.is_available(): {name}"
    build = getattr(torch.version, "cuda", None)
    why = ("a CPU-only torch build" if not build
           else f"torch built for CUDA {build} sees no GPU")
    return "cpu", "float32", f"torch.cuda.is_available() is False ({why})"


def _float32_params(params) -> dict:
    return jax.tree.map(lambda a: np.asarray(a, np.float32), params)


class TransformersPeers:
    """The transformers twins of a target (and draft), and a ``generate`` per peer.

    Attributes:
      status: peer name -> ``{"status": "ok" | "unavailable", "reason": str | None}``.
      device, dtype: where and in which dtype PyTorch runs (:func:`choose_device`), and
        device_reason: why.
    """

    def __init__(self, names: Sequence[str], target, draft=None, torch_threads: int = 0):
        """Exports and loads the models the requested peers need.

        Args:
          names: peers to prepare (subset of :data:`PEERS`).
          target, draft: specjax :class:`~specjax.Model` objects (draft may be ``None``).
          torch_threads: PyTorch CPU threads; 0: probe 1 and all cores before each prompt
            and keep the faster (see :meth:`tune_threads`).
        """
        self.names = list(names)
        self.status = {name: {"status": "ok", "reason": None} for name in self.names}
        self.device, self.dtype = "cpu", "float32"
        self.device_reason = "no peers requested"
        self.thread_candidates = ([torch_threads] if torch_threads
                                  else sorted({1, os.cpu_count() or 1}))
        self.threads_probe: dict[int, float] = {}
        self._models: dict[str, object] = {}
        if not self.names:
            return
        try:
            import torch
            import transformers  # noqa: F401
        except ImportError as err:
            self.device_reason = f"{err.name or 'torch'} is not installed"
            return self._disable(self.names, f"{err.name or 'torch'} is not installed "
                                             "(pip install 'specjax[bench]')")
        self.device, self.dtype, self.device_reason = choose_device(torch)
        if "hf-assisted" in self.names and draft is None:
            self._disable(["hf-assisted"], "no draft model (--draft)")
        try:
            self._models["target"] = self._load(target)
        except Exception as err:  # a peer that cannot load is a row, not a crash
            return self._disable(self.names, f"cannot load the target in transformers: "
                                             f"{one_line(err)}")
        if self.status.get("hf-assisted", {}).get("status") == "ok":
            try:
                self._models["draft"] = self._load(draft)
            except Exception as err:
                self._disable(["hf-assisted"], f"cannot load the draft in transformers: "
                                               f"{one_line(err)}")

    def _disable(self, names, reason: str) -> None:
        for name in names:
            self.status[name] = {"status": "unavailable", "reason": reason}

    def _load(self, model):
        import torch
        import transformers

        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # keep the benchmark's own output
        try:
            with tempfile.TemporaryDirectory(prefix="specjax-peer-") as folder:
                # The checkpoint layout: a model may run with fused projections.
                separate = models.unfuse_projections(model.config, model.params)
                save_hf_directory(model.config, _float32_params(separate), folder)
                hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                    folder, dtype=getattr(torch, self.dtype))
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        return hf_model.to(self.device).eval()

    def available(self, name: str) -> bool:
        return self.status.get(name, {}).get("status") == "ok"

    def disable(self, name: str, reason: str) -> None:
        """Marks a peer that failed during the run (status ``"error"``); it is skipped from
        then on."""
        self.status[name] = {"status": "error", "reason": reason}

    def describe(self) -> dict:
        """What the JSON records about the peers."""
        return {"device": self.device, "dtype": self.dtype, "device_reason": self.device_reason,
                "jax_backend": jax.default_backend(),
                "torch_thread_candidates": self.thread_candidates,
                "prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS,
                "peers": {name: dict(self.status[name]) for name in self.names}}

    def tune_threads(self) -> dict[int, float]:
        """Sets PyTorch's CPU thread count to the fastest of the candidates (see
        :func:`fastest_torch_threads`); returns ms per candidate ({} on a GPU)."""
        if self.device != "cpu" or "target" not in self._models:
            return {}
        self.threads_probe = fastest_torch_threads(self._models["target"],
                                                   self.thread_candidates, repeats=5)
        return self.threads_probe

    def transformers_model(self, role: str = "target"):
        """The loaded transformers model of ``role`` (``"target"`` or ``"draft"``), e.g. for a
        library that wraps it (outlines)."""
        return self._models[role]

    def generate(self, name: str, ids: Sequence[int], max_new_tokens: int,
                 temperature: float, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, logits_processor=None,
                 stop_token_ids: Sequence[int] = ()) -> tuple[list[int], float]:
        """Runs peer ``name`` on one prompt; returns (new token ids, wall seconds).

        Args:
          logits_processor: a transformers ``LogitsProcessorList`` for ``generate`` (e.g. a
            constraint's), or ``None``.
          stop_token_ids: tokens that end the output (kept in it); empty: exactly
            ``max_new_tokens`` tokens, EOS neither a stop token nor suppressed.
        """
        import torch

        model = self._models["target"]
        inputs = torch.tensor([list(ids)], device=self.device)
        kwargs = dict(attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                      eos_token_id=list(stop_token_ids) or None, pad_token_id=0)
        if logits_processor is not None:
            kwargs["logits_processor"] = logits_processor
        if temperature > 0:
            # top_k=0 disables top-k (transformers' default would be 50).
            kwargs.update(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
            torch.manual_seed(seed)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if name == "hf-assisted":
            kwargs["assistant_model"] = self._models["draft"]
        elif name == "hf-lookup":
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_NUM_TOKENS
        with torch.no_grad():
            if self.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(inputs, **kwargs)
            if self.device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        return out[0, len(ids):].tolist(), seconds


def fastest_torch_threads(hf_model, candidates: Sequence[int], repeats: int = 10
                          ) -> dict[int, float]:
    """Sets torch's thread count to the fastest for a one-token forward of ``hf_model``;
    returns the measured ms per candidate. PyTorch's OpenMP threads spin at barriers: with
    another process on the cores, 2 threads on 2 cores can be several times slower than 1,
    so the peer gets its best setting rather than the default."""
    import torch

    measured = {}
    token = torch.tensor([[1]], device=hf_model.device)
    for threads in candidates:
        torch.set_num_threads(threads)
        with torch.no_grad():
            for _ in range(3):
                hf_model(token)
            start = time.perf_counter()
            for _ in range(repeats):
                hf_model(token)
        measured[threads] = 1e3 * (time.perf_counter() - start) / repeats
    torch.set_num_threads(min(measured, key=measured.get))
    return measured


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]
