"""Checkpoint tools (installed as ``specjax.checkpoints_tools``): loading HF directories,
hub ids and GGUF files, converting them to orbax, and the shipped assets. Draft training
and n-gram building live in :mod:`specjax.training`."""
