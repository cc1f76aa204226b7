"""Where every step takes its batch: :class:`Rollouts`, with a fixed staleness bound
``rollout.max_staleness`` = k.

k = 0 is the synchronous run, inline: :meth:`Rollouts.take` produces the step's batch when the
step asks for it (no thread, no job queue), :meth:`Rollouts.after_update` pushes the updated
weights to an engine that holds its own copy, and nothing is added to the metrics or the
checkpoint. With k > 0 generation runs ahead:

With ``max_staleness = k`` the batch trained at step m is sampled with the weights after
update ``max(0, m - k)`` (policy version ``max(0, m - k)``: the number of updates applied), so
a run is a function of its config and seed however long generation and training take: the
generator works on the batches of the next k steps while the trainer updates the policy, and
the batch it trains on is k updates old (fewer in the first k steps). This is the fixed-lag
schedule of one-step off-policy RL (Noukhovitch et al. 2025, "Asynchronous RLHF") generalised
to k; the update corrects for the lag with the decoupled objective (Fu et al. 2025, AReaL):
the proximal policy is the trainer's log-probs at the start of the step, the behaviour policy
the sampler's, and the clipped loss is weighted by their truncated ratio
(``rollout.is_correction``).

The rules that keep it exact (k > 0):

- **one job at a time.** The producer (:meth:`policygrad.produce.producer.Producer.produce`: prompts,
  sampling, the reward functions, dynamic-sampling rounds, the sampled estimator inputs) runs
  one step's batch at a time, in step order, so the prompt stream is read in the order a
  synchronous run reads it;
- **drain, then sync.** After each update the trainer waits for the job in flight, then pushes
  the new weights to the engine, then starts the next job: no batch mixes two weight versions
  (asserted), and a job only ever starts on the current weights;
- **the trainer's thread keeps what needs the trainer or other ranks**: normalisation, the
  episodes' error budget, the KL controller and every collective
  (:func:`policygrad.produce.production.finish`).

Every unfinished job was started on the current weights, so a checkpoint (at any point between
steps, without waiting) keeps the finished batches and the stream position where the unfinished
ones began; a resume restores them, pushes the checkpoint's weights to the engine and starts the
unfinished jobs again, which sample exactly what they would have.

Executors (k > 0): ``thread`` (one background thread) and ``inline`` (each job runs when it is
started, in the trainer's thread: the same numbers with no overlap, for tests and debugging).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from policygrad.errors import CheckpointError
from policygrad.learn.metrics import async_metrics
from policygrad.produce.production import Production, production_from_state, production_state

__all__ = ["EXECUTORS", "Rollouts", "Taken"]

EXECUTORS = ("thread", "inline")


class _Job:
    """One step's production: started (its stream position recorded), then done (a result or
    the error it raised)."""

    def __init__(self, step: int, version: int):
        self.step, self.version = step, version
        self.position: int | None = None  # the stream position when it started
        self.result: Production | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


@dataclass(frozen=True)
class Taken:
    """A step's batch as :meth:`Rollouts.take` hands it over: the production, the seconds the
    trainer waited for it and the finished batches waiting after it (0 and 0 at k = 0)."""

    production: Production
    waited: float = 0.0
    queue: int = 0


class Rollouts:
    """The batch of every step: produced when taken (k = 0), or the next ``max_staleness`` steps'
    batches produced while the trainer trains (k > 0).

    Args:
        produce: ``produce(step, version) -> Production``, the producer's half of a step's sample
            stage with the engine's current weights (version = updates applied).
        sync: pushes the policy's current weights to the engine (called only when no job runs).
        stream: the prompt stream the producer takes from (``position`` read and restored).
        max_staleness: k >= 0.
        steps: the run's number of steps (the batches sampled by weights older than the last
            update's are produced, so that a resume with more steps finds them).
        executor: ``thread`` or ``inline``.
        engine_owns_weights: the engine samples from its own copy of the weights (required for
            k > 0: the trainer updates the policy while a job samples).

    Raises:
        ValueError: k < 0, an unknown executor, or k > 0 with an engine that samples from the
            live policy.
    """

    def __init__(
        self,
        produce: Callable[[int, int], Production],
        sync: Callable[[], None],
        stream,
        *,
        max_staleness: int,
        steps: int,
        executor: str = "thread",
        engine_owns_weights: bool = True,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if executor not in EXECUTORS:
            raise ValueError(f"unknown executor {executor!r}; valid: {', '.join(EXECUTORS)}")
        if max_staleness > 0 and not engine_owns_weights:
            raise ValueError("max_staleness > 0 needs an engine with its own copy of the weights")
        self._produce, self._sync, self.stream = produce, sync, stream
        self.max_staleness, self.steps, self.executor = max_staleness, steps, executor
        self.version = 0  # the policy version the engine holds
        self.next_step = 0  # the next step whose job is not started yet
        self.jobs: dict[int, _Job] = {}  # started and not yet taken, by step
        self._started = False
        self._lock = threading.Lock()
        self._work: list[_Job] = []
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        # torch's thread count for the jobs: the trainer's, updated between steps (num_threads null
        # adapts it to the machine's load); the worker thread applies it before each job
        self.threads = torch.get_num_threads()

    # ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        """Before the first job: a resumed pipeline pushes the checkpoint's weights first."""
        if self._started:
            return
        self._started = True
        if self.version > 0:
            self._sync()
        self._schedule()

    def _schedule(self) -> None:
        """Start every job whose batch is due on the current weights, in step order."""
        k = self.max_staleness
        # Up to step steps + k - 1: a resume with more steps needs every batch of older weights
        # (version < steps); one of the final weights would be sampled again.
        while self.next_step < self.steps + k and max(0, self.next_step - k) == self.version:
            job = _Job(self.next_step, self.version)
            self.jobs[job.step] = job
            self.next_step += 1
            if self.executor == "inline":
                self._run(job)
            else:
                self._submit(job)

    def _run(self, job: _Job) -> None:
        with self._lock:
            job.position = self.stream.position
        try:
            result = self._produce(job.step, job.version)
        except BaseException as exc:  # reported to the trainer's thread by take()/after_update()
            job.error = exc
        else:
            with self._lock:
                job.result = result
        job.done.set()

    def _submit(self, job: _Job) -> None:
        with self._wake:
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="policygrad-rollout", daemon=True)
                self._thread.start()
            self._work.append(job)
            self._wake.notify()

    def _worker(self) -> None:
        while True:
            with self._wake:
                while not self._work and not self._closed:
                    self._wake.wait()
                if self._closed and not self._work:
                    return
                job = self._work.pop(0)
            if torch.get_num_threads() != self.threads:  # the trainer's count: same kernels, same sums
                torch.set_num_threads(self.threads)
            self._run(job)

    def _wait(self, job: _Job) -> float:
        start = time.perf_counter()
        job.done.wait()
        waited = time.perf_counter() - start
        if job.error is not None:
            error, job.error = job.error, None
            self.jobs.pop(job.step, None)
            raise error
        return waited

    # ------------------------------------------------------------------------------------------
    def take(self, step: int, *, threads: int | None = None) -> Taken:
        """The batch of ``step``: at k = 0 produced now, with the current weights (version
        ``step``); at k > 0 the job's, waiting for it when it runs. ``threads``: torch's thread
        count for the jobs from now on (the trainer's, re-read before each step).

        Raises:
            RuntimeError: k > 0 and no job for ``step`` (steps taken out of order).
            Any error the producer raised for this step's batch.
        """
        if threads is not None:
            self.threads = threads  # the next job runs with the trainer's count
        if not self.max_staleness:
            return Taken(self._produce(step, step))
        self._start()
        job = self.jobs.get(step)
        if job is None:
            raise RuntimeError(
                f"the rollout pipeline has no batch for step {step} (next job: step {self.next_step})"
            )
        waited = self._wait(job)
        del self.jobs[step]
        queue = sum(1 for j in self.jobs.values() if j.done.is_set())
        return Taken(job.result, waited, queue)

    def drain(self) -> float:
        """Wait for every started job; returns the seconds waited.

        Raises:
            Any error a producer raised.
        """
        waited = 0.0
        for step in sorted(self.jobs):
            waited += self._wait(self.jobs[step])
        return waited

    def after_update(self, version: int, *, synced: bool) -> dict[str, float]:
        """The policy is now version ``version``: drain (k > 0), push the weights (when the update
        changed them and the engine holds its own copy, ``synced``) and start the jobs now due.
        Returns the seconds waited (k > 0: ``time/drain_wait_s``) and spent syncing
        (``time/weight_sync_s``, only when it synced).

        Raises:
            Any error a producer raised (the step fails within the step that waits for it).
        """
        metrics = {}
        if self.max_staleness:
            self._start()
            metrics["time/drain_wait_s"] = self.drain()
            assert all(j.done.is_set() for j in self.jobs.values()), "a weight sync while a job runs"
        self.version = version
        if synced:
            start = time.perf_counter()
            self._sync()
            metrics["time/weight_sync_s"] = time.perf_counter() - start
        if self.max_staleness:
            self._schedule()
        return metrics

    def report(self, step: int, taken: Taken, times: dict, batch, exp, stats, total) -> dict[str, float]:
        """The step's rollout metrics: at k = 0 ``times`` (:meth:`after_update`'s) alone; at
        k > 0 also the staleness, the queue, the waits and the behaviour KL
        (:func:`~policygrad.learn.metrics.async_metrics`; ``batch``, ``exp``, ``stats``: the step's
        batch, experience and update statistics; ``total``: the sum over ranks)."""
        if not self.max_staleness:
            return dict(times)
        return async_metrics(
            step, batch, exp, stats, taken.production, taken.waited, taken.queue, times, total
        )

    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The finished batches (tensors, rows and numbers only: ``weights_only``-safe), the
        stream position where the first unfinished job began (every unfinished job started on
        the current weights, so a resume starts it again) and the next step to schedule. Taken
        between steps, without waiting for the job in flight."""
        with self._lock:
            finished, first_unfinished = [], None
            for step in sorted(self.jobs):
                job = self.jobs[step]
                if job.result is not None and first_unfinished is None:
                    finished.append(production_state(job.result))
                elif first_unfinished is None:
                    first_unfinished = job
            if first_unfinished is None:
                position, next_step = self.stream.position, self.next_step
            else:
                assert first_unfinished.version == self.version, "an unfinished job of older weights"
                started = first_unfinished.position is not None
                position = first_unfinished.position if started else self.stream.position
                next_step = first_unfinished.step
            return {
                "max_staleness": self.max_staleness,
                "version": self.version,
                "finished": finished,
                "position": position,
                "next_step": next_step,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put :meth:`state_dict`'s output back (before the first :meth:`take`).

        Raises:
            ValueError: the state was written with another ``max_staleness``.
        """
        if state["max_staleness"] != self.max_staleness:
            raise ValueError(
                f"the checkpoint's batches were sampled with rollout.max_staleness={state['max_staleness']}, "
                f"this run has {self.max_staleness}"
            )
        self.version = state["version"]
        self.stream.position = state["position"]
        self.next_step = state["next_step"]
        self.jobs = {}
        for saved in state["finished"]:
            production = production_from_state(saved)
            job = _Job(production.step, production.version)
            job.result = production
            job.done.set()
            self.jobs[job.step] = job

    def save_into(self, state: dict[str, Any]) -> None:
        """Put what a checkpoint needs into the trainer's ``state``: at k > 0 the batches sampled
        ahead (``pipeline``: :meth:`state_dict`) and ``data_position`` where their prompts end; at
        k = 0 nothing (a synchronous run's checkpoint has no ``pipeline`` key)."""
        if self.max_staleness:
            state["pipeline"] = self.state_dict()
            state["data_position"] = state["pipeline"]["position"]

    def load_from(self, state: dict[str, Any], *, checkpoint: str) -> None:
        """Restore :meth:`save_into`'s part of the trainer's ``state`` (read from ``checkpoint``).

        Raises:
            CheckpointError: the checkpoint was written with another ``rollout.max_staleness``.
        """
        saved, k = state.get("pipeline"), self.max_staleness
        if saved is None and not k:
            return
        if saved is None or saved["max_staleness"] != k:
            was = saved["max_staleness"] if saved is not None else 0
            raise CheckpointError(
                f"checkpoint {checkpoint} was written with rollout.max_staleness={was}; resume it with that "
                f"value (this run has {k})"
            )
        self.load_state_dict(saved)

    def close(self, *, timeout: float | None = None) -> bool:
        """Let the job in flight finish (its batch is dropped) and stop the thread. Idempotent.

        Args:
            timeout: the most seconds to wait for the job in flight (None: as long as it takes,
                a generation or a reward call); after it the thread is left to end alone (a
                daemon thread), for a stop that must not wait: a second Ctrl-C.

        Returns:
            Whether the thread has ended (no thread: True).
        """
        with self._wake:
            self._closed = True
            self._work.clear()
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True
