"""Rollouts from vLLM servers apart from the trainer: ``rollout.engine: server``.

Design:

- **Servers.** Each is vLLM's API server started by ``policygrad serve`` (by hand, on any device
  or host) or by the run itself (:class:`~policygrad.rollout.serve.ServerProcesses`). Requests
  go to ``/inference/v1/generate``: token ids in, token ids and the sampled distribution's
  log-probs out (``processed_logprobs``), nothing re-tokenised. One request per prompt carries
  its G samples (``n = G``) and its seed, as in-process (:mod:`policygrad.rollout.vllm`), so a
  prompt's tokens depend on its seed and the weights only, never on which server answered.
- **Several servers.** Prompt i goes to server ``key mod S`` of the servers that hold the current
  weights, its key the request's ``routing_keys[i]`` (an episode's row seed, so its turns stay on
  one server) or i; a group stays on one server, with its prefix cache. Results come back in
  prompt order. A server that fails (connection refused or reset, an error answer, no answer within
  ``timeout_s``) is set aside and its prompts go to the others; with none left the call raises
  :class:`ServerError` naming the server and what happened.
- **Weights.** :meth:`ServerRolloutEngine.sync_weights` pushes the policy (checkpoint names, LoRA
  merged, the engine's dtype) to every server through its own gloo transfer group
  (:mod:`policygrad.rollout.transfer`): ``/start_weight_update``, ``/update_weights`` while the
  tensors are broadcast (each checked against its CRC-32 by the server),
  ``/reset_prefix_cache`` (no KV of the old weights is reused), ``/finish_weight_update`` with a
  new version label. The engine pushes the initial weights
  before its first sample (a server may have been started from any folder). A server whose push
  failed holds undefined weights: it is not sampled until a later push succeeds; a server the run
  started that has died is started again at the next push and gets the weights before it samples.
- **Versions.** Every returned token carries the version label of the weights that sampled it
  (vLLM's ``weight_versions``); a row whose label is not the engine's current one is refused
  (:class:`StaleWeightsError`), and each row's version number is recorded in
  ``Rollout.weight_version``.
- **Nothing hangs.** Every HTTP call and every collective has ``timeout_s``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import logging
import secrets
import time
import urllib.parse
from types import SimpleNamespace

import torch

from policygrad.rollout.base import Rollout
from policygrad.rollout.engine import GenerationRequest, RolloutEngine
from policygrad.rollout.server_api import (
    ServerError,
    ServerRequestError,
    connect,
    describe,
    healthy,
    post,
    push,
)
from policygrad.rollout.transfer import GlooTransferEndpoint
from policygrad.rollout.vllm_requests import rollout_from_outputs, sampling_fields
from policygrad.rollout.vllm_setup import (
    DTYPES,
    model_text_config,
    pushed_weight_shapes,
    request_seed,
    weights_to_push,
)

__all__ = ["ServerError", "ServerRolloutEngine", "StaleWeightsError", "start_server_engine"]

log = logging.getLogger(__name__)


class StaleWeightsError(ServerError):
    """A row sampled with other weights than the engine last pushed."""


class _Server:
    """One server as the engine knows it: its URL, its transfer group, the weights it holds."""

    def __init__(self, index: int, url: str):
        self.index, self.url = index, url.rstrip("/")
        self.endpoint: GlooTransferEndpoint | None = None
        self.version: str | None = None  # the label of the weights it holds; None: unknown
        self.failure: str | None = None  # why it is set aside


class ServerRolloutEngine(RolloutEngine):
    """Sampling on vLLM rollout servers; weights pushed to them after every update.

    Args:
        urls: base URLs of the servers (``http://host:port``), at least one.
        tokenizer: the policy's tokenizer (its pad id; the servers get token ids only).
        eos_token_ids: every id that ends a response (non-empty).
        model_path: the policy's model folder: the names and shapes every push is checked
            against (the servers must run this architecture).
        max_model_len: the servers' context in tokens (prompt + response).
        dtype: the servers' weight dtype (``float32``, ``bfloat16``, ``float16``); pushes are cast.
        timeout_s: the most seconds any request, weight push or collective may take (> 0).
        transfer_address: the address the servers reach this trainer at for weight transfer
            (None: found from the route to each server).
        processes: the :class:`~policygrad.rollout.serve.ServerProcesses` the run started (they
            are restarted when dead and stopped by :meth:`close`), or None for servers run apart.
        share: under torchrun, ``share(value) -> rank 0's value`` on every rank (e.g.
            :meth:`~policygrad.parallel.distributed.Dist.broadcast_object`): rank 0 alone pushes
            the weights, and every rank learns the new version and which servers took it. Every
            rank samples its own prompts. None in one process.
        sender: whether this process pushes the weights (rank 0; True in one process).

    Raises (on construction):
        ValueError: no URL, a URL that is not ``http(s)://host:port``, ``timeout_s`` <= 0.
        ServerError: a server that does not answer ``/health`` within ``timeout_s``.
    """

    shares_policy_weights = False

    def __init__(
        self,
        urls: list[str],
        tokenizer,
        eos_token_ids: list[int],
        *,
        model_path: str,
        max_model_len: int,
        dtype: str = "float32",
        timeout_s: float = 300.0,
        transfer_address: str | None = None,
        processes=None,
        share=None,
        sender: bool = True,
    ):
        if not urls:
            raise ValueError("rollout.servers is empty: give at least one server URL or a count")
        seen = set()
        for url in urls:
            parsed = urllib.parse.urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
                raise ValueError(f"rollout.servers: {url!r} is not a URL like http://host:8000")
            host = "127.0.0.1" if parsed.hostname == "localhost" else parsed.hostname
            if (host, parsed.port) in seen:  # two transfer groups to one server would fight
                raise ValueError(f"rollout.servers names {url!r} twice; list each server once")
            seen.add((host, parsed.port))
        if not timeout_s > 0:
            raise ValueError(f"rollout.server_timeout_s must be > 0, got {timeout_s}")
        if dtype not in DTYPES:
            raise ValueError(f"rollout.dtype for servers must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.servers = [_Server(i, u) for i, u in enumerate(urls)]
        self.tokenizer, self.eos_token_ids = tokenizer, list(eos_token_ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]
        self.model_path, self.max_model_len, self.dtype = model_path, int(max_model_len), dtype
        self.timeout_s = float(timeout_s)
        self.transfer_address = transfer_address
        self.processes = processes
        self._weight_shapes = pushed_weight_shapes(
            model_path, model_text_config(model_path, self.max_model_len)
        )
        self.share, self.sender = share, bool(sender)
        self._nonce = secrets.token_hex(4)  # labels of another trainer's pushes never match ours
        if share is not None:
            self._nonce = share(self._nonce)  # every rank checks rank 0's labels
        self.version = 0  # pushes completed; the label of push n is f"{nonce}-{n}"
        self.closed = False
        for server in self.servers:
            deadline = time.monotonic() + self.timeout_s
            while not healthy(server.url, timeout_s=min(5.0, self.timeout_s)):
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"rollout server {server.url} did not answer /health within {self.timeout_s:.0f} s "
                        "(rollout.server_timeout_s); start it with policygrad serve, or check the URL"
                    )
                time.sleep(0.5)

    @property
    def needs_weights(self) -> bool:
        """True until the first push: the servers may hold any weights until then."""
        return self.version == 0

    @property
    def label(self) -> str:
        """The version label of the weights last pushed."""
        return f"{self._nonce}-{self.version}"

    # ------------------------------------------------------------------ generation

    def _ready(self) -> list[_Server]:
        return [s for s in self.servers if s.version == self.label and s.failure is None]

    def sample(self, request: GenerationRequest) -> Rollout:
        """Sample ``group_size`` responses per prompt on the servers (the layout and the seeds of
        :meth:`VLLMRolloutEngine.sample <policygrad.rollout.vllm.VLLMRolloutEngine.sample>`).

        Raises:
            ValueError: longest prompt + ``max_new_tokens`` beyond ``max_model_len``.
            RuntimeError: the engine is closed; no weights pushed yet.
            ServerError: every server that holds the current weights failed (names the last one
                and what happened: refused, an error answer, or no answer within ``timeout_s``).
            StaleWeightsError: a row sampled with other weights than the current push.
        """
        if self.closed:
            raise RuntimeError("this ServerRolloutEngine is closed; build a new one")
        prompts, G, s = request.prompts, request.group_size, request.sampling
        longest = max(len(p) for p in prompts)
        if longest + request.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"the longest prompt ({longest} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the "
                f"servers' max_model_len of {self.max_model_len} positions; shorten the prompts or lower "
                "max_new_tokens"
            )
        if self.version == 0:
            raise RuntimeError("no weights were pushed to the rollout servers yet; call sync_weights first")
        n = len(prompts)
        if request.prompt_seeds is not None:
            seeds = [int(x) % 2**62 for x in request.prompt_seeds]
        elif request.generator_seed is None:
            seeds = torch.randint(0, 2**62, (n,), dtype=torch.long).tolist()
        else:
            seeds = [request_seed(int(request.generator_seed), i) for i in range(n)]
        bodies = [
            {
                "token_ids": prompt,
                "sampling_params": sampling_fields(
                    G, s.temperature, s.top_p, s.top_k, request.max_new_tokens, s.greedy, seed,
                    request.ignore_eos, self.eos_token_ids,
                ),
                "output_mode": "tokens",
            }
            for prompt, seed in zip(prompts, seeds, strict=True)
        ]  # fmt: skip
        keys = request.routing_keys if request.routing_keys is not None else list(range(n))
        answers = self._generate_all(bodies, keys)
        outputs = []
        for answer in answers:
            completions = []
            for choice in answer["choices"]:
                content = (choice.get("logprobs") or {}).get("content") or []
                completions.append(
                    SimpleNamespace(
                        index=choice["index"],
                        token_ids=choice.get("token_ids") or [],
                        logprobs=[{c["token_id"]: SimpleNamespace(logprob=c["logprob"])} for c in content]
                        if content
                        else None,
                        finish_reason=choice.get("finish_reason"),
                        stop_reason=choice.get("stop_reason"),
                    )
                )
            outputs.append(SimpleNamespace(outputs=completions))
        rollout = rollout_from_outputs(
            outputs,
            prompts,
            group_size=G,
            max_new_tokens=request.max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            sampling=s,
            greedy=s.greedy,
            ignore_eos=request.ignore_eos,
        )
        return dataclasses.replace(
            rollout, weight_version=torch.full((rollout.batch_size,), self.version, dtype=torch.long)
        )

    def _generate_all(self, bodies: list[dict], keys: list[int]) -> list[dict]:
        """Every body's answer, in order: body i on server ``keys[i] mod S`` of the S servers
        that can sample; a failed server's bodies go to the others."""
        answers: list[dict | None] = [None] * len(bodies)
        pending = list(range(len(bodies)))
        last_failure, stale = None, False
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(64, max(1, len(bodies)))) as pool:
            while pending:
                ready = self._ready()
                if not ready:
                    raise (StaleWeightsError if stale else ServerError)(
                        f"no rollout server can sample: {last_failure or self._failures()}; "
                        "start the servers again (or add some) and resume the run"
                    )
                futures = {}
                for i in pending:
                    server = ready[keys[i] % len(ready)]
                    call = pool.submit(post, server.url, "/inference/v1/generate", bodies[i], self.timeout_s)
                    futures[call] = (i, server)
                pending = []
                for future in concurrent.futures.as_completed(futures):
                    i, server = futures[future]
                    try:
                        answers[i] = self._checked(future.result())
                    except ServerRequestError:
                        raise  # the request itself is wrong: every server would refuse it
                    except (OSError, http.client.HTTPException, ServerError, ValueError, KeyError) as err:
                        if server.failure is None:
                            server.failure = f"rollout server {server.url}: {describe(err)}"
                            log.warning("%s; its prompts go to the other servers", server.failure)
                        last_failure = server.failure
                        stale = stale or isinstance(err, StaleWeightsError)
                        pending.append(i)
                pending.sort()
        return answers  # type: ignore[return-value]

    def _checked(self, answer: dict) -> dict:
        """``answer`` when every token of it was sampled by this run's last push; a server whose
        weights changed outside the run raises StaleWeightsError (it is set aside)."""
        for choice in answer["choices"]:
            labels = {span["version"] for span in choice.get("weight_versions") or []}
            if labels != {self.label}:
                raise StaleWeightsError(
                    f"sampled with weights {sorted(labels) or 'unlabelled'}, not this run's push "
                    f"{self.label} (its weights changed outside this run)"
                )
        return answer

    def _failures(self) -> str:
        return "; ".join(s.failure or f"rollout server {s.url}: holds other weights" for s in self.servers)

    # ------------------------------------------------------------------ weights

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s current weights to every server (a new version), concurrently.

        ``model``: the policy (a transformers causal LM of ``model_path``'s architecture, or a
        peft LoRA model around one: pushed merged). Names and shapes are checked before anything
        is sent. A server whose push fails is set aside (its weights are undefined) and the
        others go on; a dead server the run started is started again first.

        Raises:
            ValueError: a weight the servers' model lacks, or of another shape.
            ServerError: no server took the push (names each one's failure: refused, timed out,
                a digest that differs, ...).
        """
        if self.closed:
            raise RuntimeError("this ServerRolloutEngine is closed; build a new one")
        if self.share is not None:
            self.share(None)  # every rank has drained its sampling: no request runs during the push
        outcome = self._push_all(model) if self.sender else None
        if self.share is not None:  # rank 0's outcome on every rank
            outcome = self.share(outcome)
        error, version, held = outcome
        if error is not None:
            raise ServerError(error)
        self.version = version
        for server, (url, label) in zip(self.servers, held, strict=True):
            server.url, server.version = url, label
            server.failure = None if label == self.label else server.failure or "missed the last weight push"

    def _push_all(self, model: torch.nn.Module) -> tuple[str | None, int, list[tuple[str, str | None]]]:
        """Push to every server: ``(error or None, version, [(url, label held)] per server)``."""
        try:
            with torch.no_grad():
                weights = [
                    (name, tensor.detach().to("cpu").contiguous())
                    for name, tensor in weights_to_push(
                        model, self._weight_shapes, self.model_path, DTYPES[self.dtype]
                    )
                ]
        except ValueError as err:
            if self.share is None:
                raise
            return str(err), self.version, [(s.url, s.version) for s in self.servers]
        update_info = GlooTransferEndpoint.update_info(weights)
        label = f"{self._nonce}-{self.version + 1}"
        self._restart_dead()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            results = list(pool.map(lambda s: self._push(s, weights, update_info, label), self.servers))
        held = [(s.url, s.version) for s in self.servers]
        if not any(results):
            return f"no rollout server took the weights: {self._failures()}", self.version, held
        return None, self.version + 1, held

    def _restart_dead(self) -> None:
        """Start again each server of ``processes`` that has exited (it gets the weights next)."""
        if self.processes is None:
            return
        for server in self.servers:
            if server.url not in self.processes.urls:
                continue  # a server run apart
            i = self.processes.urls.index(server.url)
            code = self.processes.processes[i].poll()
            if code is None:
                continue
            log.warning("rollout server %s exited (code %s); starting it again", server.url, code)
            try:
                server.url = self.processes.start_one(i)
                self.processes.wait([i])
            except RuntimeError as err:
                server.failure = str(err)
                continue
            server.endpoint, server.version, server.failure = None, None, None

    def _push(self, server: _Server, weights, update_info: dict, label: str) -> bool:
        """One server's push; False (and the server set aside) when it fails."""
        try:
            if server.failure is not None and not healthy(server.url, timeout_s=min(5.0, self.timeout_s)):
                return False  # still down: it stays aside
            if server.endpoint is None:
                server.endpoint = connect(server.url, self.transfer_address, self.timeout_s)
            push(server.url, server.endpoint, weights, update_info, label, self.timeout_s)
        except (OSError, http.client.HTTPException, RuntimeError, ValueError) as err:
            server.version, server.endpoint = None, None  # undefined weights; a new group next time
            server.failure = f"rollout server {server.url}: weight push failed ({describe(err)})"
            log.warning("%s; it samples again once a push succeeds", server.failure)
            return False
        server.version, server.failure = label, None
        return True

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Drop the transfer groups and stop the servers this run started. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for server in self.servers:
            server.endpoint = None
        if self.processes is not None:
            self.processes.stop()

    def __enter__(self) -> ServerRolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_server_engine(
    servers: list[str] | int,
    tokenizer,
    eos_token_ids: list[int],
    *,
    model_path: str,
    max_model_len: int,
    log_dir: str,
    dtype: str = "float32",
    timeout_s: float = 300.0,
    cpus: list[list[int]] | None = None,
    gpus: list[str] | None = None,
    kv_cache_gb: float = 1.0,
    prefix_caching: bool = True,
    gpu_memory_utilization: float = 0.9,
    seed: int = 0,
    share=None,
    sender: bool = True,
) -> ServerRolloutEngine:
    """A :class:`ServerRolloutEngine` on ``servers``: URLs of running servers, or a count the
    sender starts here (:class:`~policygrad.rollout.serve.ServerProcesses` on ``cpus`` or
    ``gpus``, logs in ``log_dir``) and shares with the other ranks. The caller pushes the first
    weights (:meth:`~ServerRolloutEngine.sync_weights`) before sampling.

    Raises:
        ServerStartError: a server the run starts exited or did not answer in ``timeout_s``.
        ServerError / ValueError: as :class:`ServerRolloutEngine`.
    """
    # imported here: only a run that starts its own servers needs the launcher's process handling
    from policygrad.rollout.serve import ServerProcesses

    processes = None
    if isinstance(servers, int):
        urls = None
        if sender:
            processes = ServerProcesses(
                model_path,
                servers,
                log_dir=log_dir,
                cpus=cpus,
                gpus=gpus,
                start_timeout_s=timeout_s,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                kv_cache_gb=kv_cache_gb,
                prefix_caching=prefix_caching,
                gpu_memory_utilization=gpu_memory_utilization,
            )
            urls = processes.start()
        if share is not None:
            urls = share(urls)
    else:
        urls = list(servers)
    try:
        return ServerRolloutEngine(
            urls,
            tokenizer,
            eos_token_ids,
            model_path=model_path,
            max_model_len=max_model_len,
            dtype=dtype,
            timeout_s=timeout_s,
            processes=processes,
            share=share,
            sender=sender,
        )
    except BaseException:
        if processes is not None:
            processes.stop()
        raise
