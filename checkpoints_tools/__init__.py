"""Checkpoint tools (installed as ``specjax.checkpoints_tools``): loading HF directories,
hub ids and GGUF files, converting them to orbax, and (later) draft training and n-gram
building."""
