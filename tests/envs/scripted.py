"""A rollout engine that emits scripted ids, for testing the episode runner without a model."""

from __future__ import annotations

from collections.abc import Callable

import torch

from policygrad.rollout.base import Rollout
from policygrad.rollout.engine import GenerationRequest, RolloutEngine
from tests.tiny import EOS_ID, PAD_ID


class ScriptedEngine(RolloutEngine):
    """``script(prompt_ids, seed) -> ids`` gives each sample's ids (cut at ``max_new_tokens``);
    each id's sampler log-prob is ``-(position + 1) / 100`` of the call's row, so a test can
    tell which call and position a value came from. Every request is kept in ``requests``."""

    shares_policy_weights = True

    def __init__(self, script: Callable[[list[int], int | None], list[int]], *, eos_ids=(EOS_ID,)):
        self.script = script
        self.eos_token_ids = list(eos_ids)
        self.pad_token_id = PAD_ID
        self.requests: list[GenerationRequest] = []
        self.calls = 0

    def sample(self, request: GenerationRequest) -> Rollout:
        self.requests.append(request)
        self.calls += 1
        G = request.group_size
        rows = [p for p in request.prompts for _ in range(G)]
        seeds = [s for s in (request.prompt_seeds or [None] * len(request.prompts)) for _ in range(G)]
        outs = []
        for k, (prompt, seed) in enumerate(zip(rows, seeds)):
            ids = list(self.script(prompt, seed if seed is not None else k))[: request.max_new_tokens]
            ends = [j for j, t in enumerate(ids) if t in self.eos_token_ids]
            if ends:
                ids = ids[: ends[0] + 1]
            outs.append(ids)
        B, P, T = len(rows), max(map(len, rows)), max(max(map(len, outs)), 1)
        prompt_ids = torch.full((B, P), PAD_ID, dtype=torch.long)
        prompt_mask = torch.zeros(B, P, dtype=torch.long)
        response_ids = torch.full((B, T), PAD_ID, dtype=torch.long)
        response_mask = torch.zeros(B, T)
        logprobs = torch.zeros(B, T)
        for i, (p, o) in enumerate(zip(rows, outs)):
            prompt_ids[i, P - len(p) :] = torch.tensor(p)
            prompt_mask[i, P - len(p) :] = 1
            response_ids[i, : len(o)] = torch.tensor(o, dtype=torch.long)
            response_mask[i, : len(o)] = 1.0
            logprobs[i, : len(o)] = -(torch.arange(len(o)) + 1).float() / 100 - self.calls
        truncated = torch.tensor([not o or o[-1] not in self.eos_token_ids for o in outs])
        return Rollout(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            truncated,
            logprobs,
            torch.arange(len(request.prompts)).repeat_interleave(G),
            G,
            request.sampling,
        )

    def sync_weights(self, model) -> None:  # noqa: ARG002 - nothing to sync
        return None
