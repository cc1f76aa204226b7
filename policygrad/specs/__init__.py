"""What the registries hold, declared without torch: the config validates against these.

``policygrad.core`` implements each declared name as a torch function (an advantage estimator,
a policy loss, a KL placement) and registers it against its declaration here; the config
(:mod:`policygrad.config`) checks names, options, defaults and minimum group sizes against the
same declarations, so ``import policygrad.config`` loads no torch, transformers or vLLM. Nothing
here imports anything heavier than the standard library.

- :mod:`policygrad.specs.estimators`: advantage estimators (:class:`EstimatorSpec`: values,
  trainer-supplied inputs, minimum group size).
- :mod:`policygrad.specs.losses`: policy losses and their options with the papers' defaults.
- :mod:`policygrad.specs.kl`: KL kinds and placements (needs a reference, default kind).
- :mod:`policygrad.specs.aggregation`: the loss aggregation modes.
- :mod:`policygrad.specs.datasets`: which dataset specs name built-in code tasks.
- :mod:`policygrad.specs.engines`: whether the vLLM engine is installed.
"""
