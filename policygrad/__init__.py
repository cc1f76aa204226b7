"""policygrad: reinforcement-learning post-training of language models.

    import policygrad
    summary = policygrad.train(model=..., reward_funcs=[...], train_dataset=..., steps=100)

(:func:`policygrad.api.train`; imported on first use, so ``import policygrad`` stays light.)
"""

__version__ = "0.1.0"
__all__ = ["__version__", "train"]


def __getattr__(name: str):
    if name == "train":
        from policygrad.api import train  # imported here: keeps `import policygrad` light (api loads torch)

        return train
    raise AttributeError(f"module 'policygrad' has no attribute {name!r}")
