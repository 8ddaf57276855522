"""Exceptions raised by specjax, and the one warning it gives.

Every user-facing error is a subclass of :class:`SpecjaxError` with a one-line message that
names what was wrong and, where there is one, what to do. The CLI prints ``error: <message>``
for these and exits with status 2, without a traceback. A :class:`PerformanceWarning`
(a setting that works but runs far slower than another) prints ``specjax: warning: <message>``
there, and the command goes on.
"""


class SpecjaxError(Exception):
    """Base class of all errors specjax raises for bad input or bad files."""


class InvalidArgumentError(SpecjaxError, ValueError):
    """An argument is out of range or inconsistent (empty prompt, temperature < 0, ...)."""


class ModelNotFoundError(SpecjaxError, FileNotFoundError):
    """A model name, path or hub id could not be resolved."""


class CheckpointError(SpecjaxError):
    """A checkpoint is corrupt, truncated, or does not match the model config."""


class NumericalError(SpecjaxError, FloatingPointError):
    """The model produced non-finite logits."""


class PerformanceWarning(UserWarning):
    """A setting that works, with the same results, but is known to run far slower than an
    alternative the message names (e.g. bfloat16 parameters on a CPU)."""
