"""Evaluation of a policy on held-out rows: single-turn sampling and environment episodes."""
