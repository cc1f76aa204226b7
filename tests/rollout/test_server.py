"""The rollout-server engine (``policygrad.rollout.server``, its HTTP and push calls in
``policygrad.rollout.server_api``, the server's transfer engine in
``policygrad.rollout.transfer_worker``) against real vLLM servers of a tiny model (the session's
two, tests/conftest.py) and fake servers that misbehave on purpose.

What is checked: a server samples what the in-process vLLM engine samples (tokens, masks and
log-probs equal), before and after a weight push, and two servers what one does; and each fault
(a server killed while it generates, one that never answers, a push that stalls, a digest that
differs, weights relabelled outside the run) ends or recovers with one named error within the
timeout.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from policygrad.models.loading import load_causal_lm, load_tokenizer
from policygrad.rollout import VLLMRolloutEngine
from policygrad.rollout.server import ServerError, ServerRolloutEngine, StaleWeightsError
from policygrad.rollout.server_api import describe, post
from policygrad.rollout.transfer import GlooTransferEndpoint, GlooUpdateInfo, broadcast_options, open_group

pytestmark = pytest.mark.integration

# Every 7th id ends a response, so short runs of the random model give early EOS and truncation.
MANY_EOS = list(range(2, 100, 7))
PROMPTS = [[1, 5, 6, 7], [1, 9, 3], [1, 20, 21, 22, 23, 24]]
SEEDS = [11, 12, 13]
FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated", "sampler_logprobs")


@pytest.fixture(scope="module")
def policy(server_model_dir):
    model = load_causal_lm(server_model_dir, dtype=torch.float32)
    return model.eval(), load_tokenizer(server_model_dir)


def _engine(urls, model_dir, tokenizer, **kwargs) -> ServerRolloutEngine:
    return ServerRolloutEngine(
        list(urls), tokenizer, MANY_EOS, model_path=model_dir, max_model_len=512, **kwargs
    )


def _sample(engine, **kwargs):
    args = dict(group_size=3, temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=12, prompt_seeds=SEEDS)
    return engine.generate(PROMPTS, **{**args, **kwargs})


def _assert_same(a, b, logprobs_atol: float = 0.0):
    for name in FIELDS:
        if name == "sampler_logprobs" and logprobs_atol:
            gap = (a.sampler_logprobs - b.sampler_logprobs).abs().max().item()
            print(f"sampler_logprobs: largest difference {gap:.3g}")
            assert gap <= logprobs_atol, gap
        else:
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_server_samples_what_the_in_process_engine_samples_and_two_what_one_does(
    rollout_servers, server_model_dir, policy, tmp_path
):
    urls, _ = rollout_servers
    model, tok = policy
    inproc = VLLMRolloutEngine(
        server_model_dir, tok, MANY_EOS, max_model_len=512, kv_cache_gb=0.05, cache_dir=str(tmp_path)
    )
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    engines = [inproc]
    # One engine at a time per server: an engine's first push makes the server's transfer group
    # its own, and relabels the weights (rows of an engine pushed over since are refused).
    try:
        for weights in ("start", "scaled"):
            if weights == "scaled":
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.3)
            inproc.sync_weights(model)
            expected = _sample(inproc)
            assert expected.response_mask.sum() < expected.response_mask.numel()  # some ended early
            one = _engine(urls[:1], server_model_dir, tok)
            engines.append(one)
            one.sync_weights(model)
            from_one = _sample(one)
            _assert_same(expected, from_one)
            assert torch.equal(from_one.weight_version, torch.ones(9, dtype=torch.long))
            _assert_same(_sample(inproc, greedy=True), _sample(one, greedy=True))
            one.sync_weights(model)  # a second push: version 2, the same tokens
            assert torch.equal(_sample(one).weight_version, torch.full((9,), 2, dtype=torch.long))
            two = _engine(urls, server_model_dir, tok)
            engines.append(two)
            two.sync_weights(model)
            _assert_same(expected, _sample(two))
            with pytest.raises(StaleWeightsError):
                _sample(one)  # ``two`` pushed to its server since
            if weights == "start":
                first = expected
        assert not torch.equal(first.response_ids, expected.response_ids)  # the new weights sample anew
    finally:
        model.load_state_dict(saved)
        for engine in engines:
            engine.close()


def test_a_server_killed_while_it_generates_loses_nothing_and_is_started_again(
    rollout_servers, server_model_dir, policy, tmp_path
):
    from policygrad.rollout.serve import ServerProcesses

    urls, _ = rollout_servers
    model, tok = policy
    own = ServerProcesses(server_model_dir, 1, log_dir=str(tmp_path), max_model_len=512, kv_cache_gb=1)
    engine = _engine([urls[0], *own.start()], server_model_dir, tok, processes=own, timeout_s=60)
    try:
        engine.sync_weights(model)
        many = dict(prompt_seeds=list(range(40)), max_new_tokens=100, ignore_eos=True)
        expected = engine.generate(PROMPTS * 13 + [[1, 2]], group_size=2, **many)
        got = {}
        worker = threading.Thread(
            target=lambda: got.update(r=engine.generate(PROMPTS * 13 + [[1, 2]], group_size=2, **many))
        )
        worker.start()
        time.sleep(0.2)  # its requests are in flight
        os.killpg(own.processes[0].pid, signal.SIGKILL)
        worker.join(timeout=120)
        assert not worker.is_alive()
        # its prompts went to the other server, seeded alike: the same tokens; the log-probs to
        # fp32 rounding, as the survivor's batches are not those it ran before (vLLM's CPU GEMMs
        # sum in an order that depends on the batch; observed differences ~1e-6)
        _assert_same(expected, got["r"], logprobs_atol=1e-4)
        assert engine.servers[1].failure.startswith(f"rollout server {own.urls[0]}")

        engine.sync_weights(model)  # started again, and given the weights before it samples
        assert own.processes[0].poll() is None
        assert [s.version for s in engine.servers] == [engine.label, engine.label]
        assert all(s.failure is None for s in engine.servers)
        _assert_same(
            expected, engine.generate(PROMPTS * 13 + [[1, 2]], group_size=2, **many), logprobs_atol=1e-4
        )
    finally:
        engine.close()
    assert own.processes[0].poll() is not None  # close stops the servers the engine was given


# ----------------------------------------------------------------------------- fake servers


class _Fake(BaseHTTPRequestHandler):
    """A server that answers /health and, by ``behaviour``: ``silent`` never answers anything
    else; ``stall`` joins the transfer group, then never receives; ``hang`` takes weight pushes
    properly (digests checked) and never answers a generation."""

    behaviour = "silent"
    group = None

    def log_message(self, *args):
        pass

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._answer({})
        else:
            time.sleep(30)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        kind = type(self).behaviour
        if kind == "silent" or (kind == "hang" and self.path == "/inference/v1/generate"):
            time.sleep(30)
            return
        if self.path == "/init_weight_transfer_engine":
            info = body["init_info"]
            type(self).group = open_group(info["master_address"], info["master_port"], 1, info["timeout_s"])
        elif self.path == "/update_weights":
            if kind == "stall":
                time.sleep(30)
                return
            update = GlooUpdateInfo(**body["update_info"])
            for dtype, shape in zip(update.dtype_names, update.shapes, strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                type(self).group.broadcast([tensor], broadcast_options()).wait()
        elif self.path == "/reset_prefix_cache":
            self._answer({"success": True})
            return
        self._answer({})


@pytest.fixture
def fake_server():
    servers = []

    def start(behaviour: str) -> str:
        handler = type("Fake", (_Fake,), {"behaviour": behaviour})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()


def test_a_server_that_never_answers_is_named_within_the_timeout(fake_server, server_model_dir, policy):
    model, tok = policy
    engine = _engine([fake_server("silent")], server_model_dir, tok, timeout_s=2)
    start = time.monotonic()
    with pytest.raises(
        ServerError,
        match=r"no rollout server took the weights: rollout server http://\S+: "
        r"weight push failed \(no answer within the timeout\)",
    ):
        engine.sync_weights(model)
    assert time.monotonic() - start < 10  # 2 s, not the 30 s the fake sleeps


def test_a_stalled_weight_push_is_named_and_the_other_server_goes_on(
    rollout_servers, fake_server, server_model_dir, policy
):
    urls, _ = rollout_servers
    model, tok = policy
    stalled = fake_server("stall")
    engine = _engine([stalled, urls[0]], server_model_dir, tok, timeout_s=10)
    reference = _engine(urls[:1], server_model_dir, tok)
    try:
        reference.sync_weights(model)
        expected = _sample(reference)
        start = time.monotonic()
        engine.sync_weights(model)  # the real server took it
        assert time.monotonic() - start < 30
        assert engine.servers[0].version is None and "weight push failed" in engine.servers[0].failure
        _assert_same(expected, _sample(engine))  # every prompt went to the real server
        alone = _engine([stalled], server_model_dir, tok, timeout_s=3)
        with pytest.raises(ServerError, match="no rollout server took the weights.*weight push failed"):
            alone.sync_weights(model)
    finally:
        engine.close()
        reference.close()


def test_a_server_that_stops_answering_a_generation_hands_its_prompts_on(
    rollout_servers, fake_server, server_model_dir, policy
):
    urls, _ = rollout_servers
    model, tok = policy
    engine = _engine([fake_server("hang"), urls[0]], server_model_dir, tok, timeout_s=10)
    try:
        engine.sync_weights(model)  # both took the weights
        assert all(s.version == engine.label for s in engine.servers)
        start = time.monotonic()
        got = _sample(engine)
        assert time.monotonic() - start < 30
        assert "no answer within the timeout" in engine.servers[0].failure
        reference = _engine(urls[1:], server_model_dir, tok)  # the other session server
        reference.sync_weights(model)
        _assert_same(_sample(reference), got)
        engine.servers[1].failure = "set aside by the test"
        with pytest.raises(ServerError, match="no rollout server can sample: .*no answer within the timeout"):
            _sample(engine)
    finally:
        engine.close()


def test_a_digest_that_differs_is_named_and_the_next_push_recovers(
    rollout_servers, server_model_dir, policy, monkeypatch
):
    urls, _ = rollout_servers
    model, tok = policy
    engine = _engine(urls[:1], server_model_dir, tok, timeout_s=30)
    reference = _engine(urls[1:], server_model_dir, tok)
    try:
        engine.sync_weights(model)
        update_info = GlooTransferEndpoint.update_info

        def corrupt(weights):
            info = update_info(weights)
            info["digests"][3] = "0" * 8
            return info

        monkeypatch.setattr(GlooTransferEndpoint, "update_info", staticmethod(corrupt))
        name = engine_weights_name(model, 3)
        message = rf"weight {name} arrived with CRC-32 [0-9a-f]{{8}}, the trainer sent 00000000"
        with pytest.raises(ServerError, match=message):
            engine.sync_weights(model)
        assert engine.servers[0].version is None
        with pytest.raises(ServerError, match="no rollout server can sample"):
            _sample(engine)  # undefined weights are never sampled
        monkeypatch.setattr(GlooTransferEndpoint, "update_info", staticmethod(update_info))
        engine.sync_weights(model)
        reference.sync_weights(model)
        _assert_same(_sample(reference), _sample(engine))
    finally:
        engine.close()
        reference.close()


def engine_weights_name(model, index: int) -> str:
    """The name of the ``index``-th weight a push sends."""
    from policygrad.models.adapters import merged_weights

    return list(merged_weights(model))[index][0]


def test_weights_relabelled_outside_the_run_are_refused(rollout_servers, server_model_dir, policy):
    urls, _ = rollout_servers
    model, tok = policy
    engine = _engine(urls, server_model_dir, tok)
    try:
        engine.sync_weights(model)
        expected = _sample(engine)
        post(urls[0], "/update_weight_version", {"new_version": "someone-else"}, 30)
        # its rows are refused and its prompts go to the other server: the same tokens
        _assert_same(expected, _sample(engine), logprobs_atol=1e-4)
        assert "sampled with weights ['someone-else'], not this run's push" in engine.servers[0].failure
        post(urls[1], "/update_weight_version", {"new_version": "someone-else"}, 30)
        with pytest.raises(StaleWeightsError, match=r"no rollout server can sample: .*\['someone-else'\]"):
            _sample(engine)
        engine.sync_weights(model)  # a push gives both this run's weights again
        _assert_same(expected, _sample(engine))
    finally:
        engine.close()


def test_bad_arguments_are_named(server_model_dir, policy, fake_server):
    _, tok = policy
    with pytest.raises(ValueError, match="is not a URL like http://host:8000"):
        _engine(["localhost:8000"], server_model_dir, tok)
    with pytest.raises(ValueError, match="at least one server"):
        _engine([], server_model_dir, tok)
    with pytest.raises(ValueError, match="names 'http://localhost:8000/' twice"):
        _engine(["http://127.0.0.1:8000", "http://localhost:8000/"], server_model_dir, tok)
    engine = _engine([fake_server("silent")], server_model_dir, tok)
    with pytest.raises(RuntimeError, match="no weights were pushed"):
        _sample(engine)
    with pytest.raises(ValueError, match="exceeds the servers' max_model_len of 512"):
        engine.generate([[1] * 510], max_new_tokens=10)


def test_prompts_of_one_routing_key_go_to_one_server(rollout_servers, server_model_dir, policy, monkeypatch):
    # An episode's turns carry its row's seed as their key (policygrad.envs.episodes): they stay
    # on one server, with its prefix cache. Keys change no token.
    import policygrad.rollout.server as server_module

    urls, _ = rollout_servers
    model, tok = policy
    engine = _engine(urls, server_model_dir, tok)
    sent = []

    def recording_post(url, path, body, timeout_s):
        if path == "/inference/v1/generate":
            sent.append((url, body["token_ids"]))
        return post(url, path, body, timeout_s)

    try:
        engine.sync_weights(model)
        plain = _sample(engine)
        monkeypatch.setattr(server_module, "post", recording_post)
        keyed = _sample(engine, routing_keys=[7, 7, 8])
        _assert_same(plain, keyed)
        where = {tuple(ids): url for url, ids in sent}
        assert where[tuple(PROMPTS[0])] == where[tuple(PROMPTS[1])] == urls[7 % 2]
        assert where[tuple(PROMPTS[2])] == urls[8 % 2]
    finally:
        engine.close()


def test_a_timeout_reads_the_same_whichever_timer_fired():
    """A server that never answers fails the push on the HTTP request's timeout or, under load,
    first on the process-group store's wait (torch's DistStoreError): both read as a timeout, so
    the run's message does not depend on the machine's load."""
    from torch.distributed import DistStoreError  # the store's timeout while the server never joined

    for err in (
        TimeoutError("timed out"),
        OSError("timed out"),  # urllib's socket timeout, as its message says it
        DistStoreError("wait timeout after 2000ms, keys: /0/1"),
    ):
        assert describe(err) == "no answer within the timeout", err
    assert describe(ConnectionRefusedError(111, "Connection refused")) == (
        "ConnectionRefusedError: [Errno 111] Connection refused"
    )
