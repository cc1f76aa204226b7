"""The learner: the experience record, the policy objective, the update loop, the critic and
the optimizer step, and the metrics of a step."""
