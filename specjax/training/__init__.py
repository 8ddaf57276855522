"""Draft training and the text it trains on (installed as ``specjax.training``).

Modules, one concern each, importing the core and :mod:`specjax.checkpoints_tools` (never
the other way round, and never the front: API, CLI, loading; ``tests/test_import_layers.py``).
They work on loaded models; the commands (``specjax train-draft``, ``specjax build-ngram``)
are :mod:`specjax.commands`'.

* :mod:`~specjax.training.config`: :class:`~specjax.training.config.TrainConfig`;
* :mod:`~specjax.training.corpus`: the file corpus, its held-out split and batch windows;
* :mod:`~specjax.training.target_corpus`: the target's own text (self-distillation);
* :mod:`~specjax.training.sample_corpus`: batched seeded sampling from a target or draft;
* :mod:`~specjax.training.drafts`: the draft a run starts from and its vocabulary;
* :mod:`~specjax.training.steps`: the jitted training and evaluation steps, the optimizer;
* :mod:`~specjax.training.loop`: the resumable training loop and the draft's export;
* :mod:`~specjax.training.export`: a run's latest state as a draft or shipped asset;
* :mod:`~specjax.training.feature_draft`, :mod:`~specjax.training.eagle3`: the feature
  (EAGLE-style) and EAGLE-3 drafts' parameters and losses;
* :mod:`~specjax.training.ngram_build`: the n-gram tables (``specjax build-ngram``).
"""
