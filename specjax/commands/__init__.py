"""The commands beside ``specjax generate`` (``specjax convert``, ``specjax models``,
``specjax train-draft``, ``specjax build-ngram``): their flags and entry points, which load
models by name. The work is the library's (:mod:`specjax.checkpoints_tools`,
:mod:`specjax.training`); ``specjax.cli`` registers the commands."""
