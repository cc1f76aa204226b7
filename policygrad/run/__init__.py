"""A training run around a :class:`~policygrad.trainer.loop.Trainer`: the run directory,
resume, checkpoints, signals, evaluation cadence, trackers, the summary and the model card.

    from policygrad.run import Run
    run = Run(config)
    summary = run.train()
"""

from policygrad.run.run import Run

__all__ = ["Run"]
