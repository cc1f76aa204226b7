"""Data-parallel training over ``torch.distributed``: one process per device, started by torchrun.

``torchrun --nproc_per_node=N -m policygrad train CONFIG [--key=value ...]`` starts N processes;
:func:`init_from_env` joins them into one process group (gloo on CPU, nccl on CUDA, one device
per process from ``LOCAL_RANK``). With one process (no torchrun, or ``--nproc_per_node=1``) no
group is created and every helper here is the identity: the run is the single-process run.

What each rank does, with the global batch fixed by the config (``rollout.prompts_per_step``
prompts, divisible by the world size):

- **sampling**: every rank takes the same ``prompts_per_step`` prompts from the stream (so the
  data position stays one number) and keeps its contiguous share; a group of G samples never
  spans ranks. Each prompt samples from its own seed, ``prompt_seed(run seed, step, round,
  global position)``, so its samples do not depend on the rank it lands on.
- **statistics of the whole batch** are reduced across ranks (:meth:`Dist.reduce`): the
  minibatch token and sequence counts of the loss aggregation, the critic's token count, batch
  whitening of rewards and advantages (and inside ``reinforce_pp``), running reward
  normalisation, the approx-KL of ``optim.target_kl``, and whether a minibatch has any token.
  The step's metrics and the KL controller's input are computed from the batch gathered from all
  ranks (:meth:`Dist.gather_rows`), with the same functions as a single-process run.
- **gradients** (unsharded, DDP-style): after the micro-batches' backward passes every gradient
  is summed over ranks (the losses are already normalised by the global counts, so the sum is
  the gradient of the global batch), together with the decision whether every rank's loss was
  finite, so all ranks step or skip together.
- **minibatches**: one global row permutation per epoch, each rank training on its rows of each
  global minibatch, so minibatch membership is that of a single-process run.

Only rank 0 writes the run directory (config, metrics, evaluation, checkpoints, summary) and
logs; the checkpoint is a full one, so a run resumes with any world size.

Failure: a rank that raises exits non-zero; torchrun then stops the other ranks (which may be
waiting in a collective), so the error is printed once, by the rank that failed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as td

from policygrad.config.train import ConfigError
from policygrad.learn.experience import PER_ROW_FIELDS, PER_TOKEN_FIELDS
from policygrad.produce.stages import SampledBatch
from policygrad.rollout.base import Rollout

__all__ = ["Dist", "NullLogger", "init_from_env", "shutdown"]

log = logging.getLogger("policygrad")

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: ``rank`` of ``world_size``, and its ``device``.

    With ``world_size`` 1 every method returns its input (no process group is touched)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run directory and logs."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    @classmethod
    def current(cls) -> Dist:
        """The context of the initialised default process group (single process when none)."""
        if not (td.is_available() and td.is_initialized()) or td.get_world_size() == 1:
            return cls(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return cls(td.get_rank(), td.get_world_size(), _default_device())

    def check(self, cfg) -> None:
        """What a data-parallel run needs of the config.

        Raises:
            ConfigError: ``rollout.prompts_per_step`` not divisible by the world size (a group
                never spans ranks); ``drop_zero_variance_groups`` with more than one rank (its
                refill is not yet split over ranks). (``fsdp`` with LoRA: :func:`make_strategy`.)
        """
        if not self.active:
            return
        n = cfg.rollout.prompts_per_step
        if n % self.world_size:
            raise ConfigError(
                f"rollout.prompts_per_step={n} must be divisible by the world size {self.world_size}: "
                "each rank samples whole groups of an equal share of the prompts"
            )
        if cfg.drop_zero_variance_groups:
            raise ConfigError(
                "drop_zero_variance_groups=true is not supported with more than one process yet; "
                "run it in one process or set drop_zero_variance_groups=false"
            )

    def any(self, flag: bool) -> bool:
        """True when ``flag`` is True on any rank (``flag`` itself in one process)."""
        if not self.active:
            return bool(flag)
        return bool(self.reduce(torch.tensor(float(bool(flag)), device=self.device), "max").item() > 0)

    def broadcast_object(self, value):
        """Rank 0's ``value`` (any picklable object) on every rank (``value`` in one process)."""
        if not self.active:
            return value
        box = [value]
        td.broadcast_object_list(box, src=0)
        return box[0]

    def first(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (``flag`` itself in one process): decisions that read
        a clock, so every rank takes the same branch."""
        if not self.active:
            return bool(flag)
        value = torch.tensor([float(bool(flag))], device=self.device)
        td.broadcast(value, src=0)
        return bool(value.item() > 0)

    def barrier(self) -> None:
        """Wait for every rank (a no-op in one process)."""
        if self.active:
            td.barrier()

    def equal_passes(self, count: int) -> int:
        """The largest ``count`` over ranks: how many sharded forward/backward passes every rank
        runs on a minibatch (a rank with fewer runs zero-weight passes, so the collectives of
        FSDP's all-gathers and reduce-scatters pair up)."""
        return int(self.reduce(torch.tensor(count, dtype=torch.long, device=self.device), "max").item())

    def agree_finite(self, finite: bool) -> bool:
        """True only when ``finite`` is True on every rank (gradients already reduced by FSDP)."""
        return not self.any(not finite)

    # -- collectives ---------------------------------------------------------------------------
    def reduce(self, value: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``value`` (a tensor, any shape) reduced element-wise over ranks with ``op`` (``sum``,
        ``max`` or ``min``); a new tensor on ``value``'s device and dtype."""
        if not self.active:
            return value
        out = value.detach().clone().to(self.device)
        td.all_reduce(out, op=getattr(td.ReduceOp, _OPS[op]))
        return out.to(value.device)

    @property
    def batch_reduce(self):
        """:meth:`reduce` for ``core`` functions' ``reduce=`` argument; None with one process
        (the core functions then run their single-process code path unchanged)."""
        return self.reduce if self.active else None

    def union(self, names) -> list[str]:
        """The sorted union over ranks of the strings ``names`` (sorted ``names`` in one process)."""
        if not self.active:
            return sorted(names)
        every: list[list[str]] = [[] for _ in range(self.world_size)]
        td.all_gather_object(every, sorted(names))
        return sorted({name for names_r in every for name in names_r})

    def total(self, value) -> float:
        """A local count or sum (number or 0-d tensor) summed over ranks, as a float."""
        if not self.active:
            return float(value)
        return float(self.reduce(torch.as_tensor(value, dtype=torch.float64)))

    def gather_rows(self, value: torch.Tensor | None, *, left: bool = False) -> torch.Tensor | None:
        """The rows of every rank's ``value`` [B_r, ...] concatenated in rank order; a second
        dimension that differs between ranks is padded with zeros to the widest (on the left with
        ``left``, as prompts are). Rows per rank may differ."""
        if value is None or not self.active:
            return value
        shape = torch.tensor(list(value.shape), dtype=torch.long, device=self.device)
        shapes = [torch.zeros_like(shape) for _ in range(self.world_size)]
        td.all_gather(shapes, shape)
        widest = max(int(s[1]) for s in shapes) if value.dim() > 1 else 0
        rows = max(int(s[0]) for s in shapes)
        local = value.detach().to(self.device)
        if value.dim() > 1 and local.shape[1] < widest:
            extra = widest - local.shape[1]
            local = torch.nn.functional.pad(local, (extra, 0) if left else (0, extra))
        padded = local.new_zeros((rows, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        if padded.dtype == torch.bool:  # gloo has no bool all_gather
            parts = [p.to(torch.uint8) for p in parts]
            td.all_gather(parts, padded.to(torch.uint8))
            parts = [p.bool() for p in parts]
        else:
            td.all_gather(parts, padded)
        return torch.cat([p[: int(s[0])] for p, s in zip(parts, shapes)]).to(value.device)

    def sync_gradients(self, params, finite: bool) -> bool:
        """Sum every parameter's gradient over ranks (a missing gradient counts as zeros) and
        agree on ``finite``: True only when it is True on every rank. With one process: returns
        ``finite``. Called by every rank once per optimizer step, before clipping."""
        if not self.active:
            return finite
        if not self.agree_finite(finite):
            return False
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        # One flat buffer per dtype: a few large all-reduces instead of one per tensor.
        for dtype in {g.dtype for g in grads}:
            group = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in group])
            td.all_reduce(flat)
            offset = 0
            for g in group:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        return True

    # -- the batch -----------------------------------------------------------------------------
    def share(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` prompts (``n`` divisible by ``world_size``)."""
        per = n // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)

    def gather_rollout(self, rollout: Rollout) -> Rollout:
        """Every rank's rollout as one, groups renumbered in rank order."""
        if not self.active:
            return rollout
        return rollout.gather(self.gather_rows, self.rank_offsets(rollout.num_groups))

    def rank_offsets(self, count: int) -> int:
        """The sum of ``count`` over the ranks before this one (an exclusive prefix sum)."""
        if not self.active:
            return 0
        counts = self.gather_rows(torch.tensor([count], device=self.device))
        return int(counts[: self.rank].sum())

    def gather_batch(self, batch: SampledBatch) -> SampledBatch:
        """Every rank's scored batch as one (rows and completions are kept local: metrics need
        only the tensors)."""
        if not self.active:
            return batch
        scores = batch.scores.gather(self.gather_rows)
        episodes = batch.episodes.gather(self.gather_rows) if batch.episodes is not None else None
        rollout = self.gather_rollout(batch.rollout)
        return SampledBatch(batch.rows, batch.prompt_ids, rollout, [], scores, episodes)

    def gather_experience(self, exp):
        """Every rank's :class:`~policygrad.learn.experience.Experience` as one (for metrics)."""
        if not self.active:
            return exp
        names = PER_TOKEN_FIELDS + PER_ROW_FIELDS
        changes = {name: self.gather_rows(getattr(exp, name)) for name in names}
        rollout = self.gather_rollout(exp.rollout)
        return dataclasses.replace(exp, rows=torch.arange(rollout.batch_size), rollout=rollout, **changes)

    def reduce_update_stats(self, stats):
        """A copy of :class:`~policygrad.learn.update.UpdateStats` with every rank's share summed
        (token-weighted sums and weights, losses, counts), maxima maximised and the pre-update
        log-probs gathered. Gradient norms are already global (taken after the gradient sum)."""
        if not self.active:
            return stats
        out = dataclasses.replace(stats)
        # a rank that forwarded no row (optim.skip_zero_advantage_rows) has no metrics of its own
        keys = self.union(stats.sums)
        if keys:
            sums = self.reduce(torch.tensor([stats.sums.get(k, 0.0) for k in keys], dtype=torch.float64))
            out.sums = dict(zip(keys, sums.tolist()))
        keys = self.union(stats.maxima)
        if keys:
            local = [stats.maxima.get(k, -math.inf) for k in keys]
            maxima = self.reduce(torch.tensor(local, dtype=torch.float64), "max")
            out.maxima = dict(zip(keys, maxima.tolist()))
        out.weight = self.total(stats.weight)
        out.entropy_before = self.reduce(torch.tensor(stats.entropy_before, dtype=torch.float64)).tolist()
        out.nonfinite_tokens = int(self.total(stats.nonfinite_tokens))
        out.rows = [int(n) for n in self.reduce(torch.tensor(stats.rows, dtype=torch.float64)).tolist()]
        if stats.losses:
            out.losses = self.reduce(torch.tensor(stats.losses, dtype=torch.float64)).tolist()
        if stats.ptx_losses:
            ptx = self.reduce(torch.tensor(stats.ptx_losses, dtype=torch.float64))
            out.ptx_losses = (ptx / self.world_size).tolist()
        out.rollout_logprobs = self.gather_rows(stats.rollout_logprobs)
        out.rollout_rows = self.gather_rows(stats.rollout_rows)
        return out

    def minibatch_shard(self, local_rows: int) -> tuple[int, int] | None:
        """``(offset, global rows)`` of this rank's rows in the step's global batch, for
        :meth:`Experience.minibatches`; None with one process."""
        if not self.active:
            return None
        return self.rank_offsets(local_rows), int(self.total(local_rows))


class NullLogger:
    """The metrics logger of a rank other than 0: logs nothing (rank 0 writes the run's files)."""

    path = ""

    def log(self, step: int, metrics) -> None:
        pass

    def close(self) -> None:
        pass


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_from_env() -> Dist:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``): nccl with one CUDA device per process, gloo on CPU. With no
    torchrun variables or ``WORLD_SIZE=1`` nothing is initialised.

    Raises:
        RuntimeError: more processes on a node than CUDA devices.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist.current()
    if not td.is_initialized():
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                raise RuntimeError(
                    f"LOCAL_RANK={local} but this node has {torch.cuda.device_count()} CUDA devices; "
                    "start at most one process per device (--nproc_per_node)"
                )
            torch.cuda.set_device(local)
            td.init_process_group("nccl")
        else:
            td.init_process_group("gloo")
    dist = Dist.current()
    if not dist.is_main:
        logging.getLogger("policygrad").setLevel(logging.ERROR)  # rank 0 reports progress and notes
    return dist


def shutdown() -> None:
    """Leave the process group (a no-op when none was joined)."""
    if td.is_available() and td.is_initialized():
        td.destroy_process_group()
