"""The commands of draft training (``specjax train-draft``, ``specjax build-ngram``): their
flags and entry points, which load models by name. The work is :mod:`specjax.training`'s,
on loaded models; ``specjax.cli`` registers the commands."""
