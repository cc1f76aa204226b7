"""A training run around a :class:`~policygrad.trainer.loop.Trainer`: the run directory,
resume, checkpoints, signals, evaluation cadence, trackers, the summary and the model card.

    from policygrad.run import Run
    run = Run(config)
    summary = run.train()
"""

__all__ = ["Run"]


def __getattr__(name: str):
    if name == "Run":
        # imported on first use: the command line imports run.interrupts without the trainer's modules
        from policygrad.run.run import Run

        return Run
    raise AttributeError(f"module 'policygrad.run' has no attribute {name!r}")
