"""The training loop on rollout servers (``rollout.engine: server``; skipped where vLLM is not
installed): in fp32 a run on one server gives the numbers and weights of the in-process vLLM
engine, two servers give those of one, and rollouts ahead (k = 1) on a server keep their
identities (thread == inline, 2 + resume + 2 == 4).

The session's two servers of a tiny model serve the tests (tests/conftest.py); every run pushes
its own weights first, so runs do not see each other's."""

from __future__ import annotations

import json
import math
import os
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from policygrad.rollout.server import ServerError
from policygrad.rollout.vllm import vllm_available
from policygrad.run import Run
from policygrad.trainer.loop import Trainer
from tests.training import checkpoint_weights, tiny_overrides

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not vllm_available(), reason="vllm is not installed"),
]

# Wall-clock readings, and the weight-sync time that only engines with a push report.
SKIP = ("time/", "perf/", "memory/", "async/overlap", "async/queue")


@pytest.fixture
def servers(rollout_servers):
    return rollout_servers[0]


@pytest.fixture
def model_dir(server_model_dir):
    return server_model_dir


def _run(make_config, name, model_dir, steps=5, **rollout):
    engine = rollout.pop("engine", "server")
    extra = {"vllm_kv_cache_gb": 0.05} if engine == "vllm" else {}
    cfg = make_config(
        name,
        steps=steps,
        model={"name": model_dir},
        rollout={"engine": engine, **extra, **rollout},
    )
    return Run(cfg)


def _train(run, steps):
    try:
        rows = [run.trainer.step() for _ in range(steps)]
        weights = {k: v.clone() for k, v in run.trainer.policy.state_dict().items()}
    finally:
        run.close()
    return rows, weights


def _same(a_rows, b_rows):
    """Every logged value equal (NaN equal to NaN), wall-clock readings aside."""
    assert len(a_rows) == len(b_rows)
    for step, (a, b) in enumerate(zip(a_rows, b_rows, strict=True), 1):
        keys = {k for k in a if not k.startswith(SKIP)}
        assert keys == {k for k in b if not k.startswith(SKIP)}, step
        for k in keys:
            u, v = a[k], b[k]
            assert u == v or (isinstance(u, float) and math.isnan(u) and math.isnan(v)), (step, k, u, v)


def _same_weights(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_one_server_trains_as_the_in_process_engine_and_two_as_one(make_config, model_dir, servers):
    inproc, w_inproc = _train(_run(make_config, "inproc", model_dir, engine="vllm"), 5)
    one, w_one = _train(_run(make_config, "one", model_dir, servers=servers[:1]), 5)
    two, w_two = _train(_run(make_config, "two", model_dir, servers=servers), 5)
    _same(inproc, one)
    _same_weights(w_inproc, w_one)
    _same(one, two)
    _same_weights(w_one, w_two)
    # the runs trained (lr 1e-2 moves a tiny model's weights every step) and pushed every update
    assert all(r["optim/steps"] == 1 for r in one)
    assert all(r["time/weight_sync_s"] > 0 for r in one)


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_rollouts_ahead_on_a_server_keep_thread_equal_inline_and_resume_equal_straight(
    make_config, model_dir, servers, monkeypatch
):
    ahead = {"servers": servers[:1], "max_staleness": 1}
    thread = Run(
        make_config("thread", steps=4, model={"name": model_dir}, rollout={"engine": "server", **ahead})
    )
    thread.train()
    inline = Run(
        make_config(
            "inline",
            steps=4,
            model={"name": model_dir},
            rollout={"engine": "server", "async_executor": "inline", **ahead},
        )
    )
    inline.train()
    _same(_rows(thread.run_dir), _rows(inline.run_dir))
    _same_weights(checkpoint_weights(thread.run_dir, 4), checkpoint_weights(inline.run_dir, 4))
    assert any(r.get("async/staleness", 0) > 0 for r in _rows(thread.run_dir))

    # 2 steps, a checkpoint, the run dies in step 3; resumed, it finishes as the straight run did
    cfg = make_config(
        "resumed", steps=4, save_every=2, model={"name": model_dir}, rollout={"engine": "server", **ahead}
    )
    step = Trainer.step

    def dies_at_step_3(self):
        if self.step_idx == 2:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Trainer, "step", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg).train()
    monkeypatch.setattr(Trainer, "step", step)
    resumed = Run(cfg, resume_from=cfg.output_dir)
    assert resumed.trainer.step_idx == 2
    resumed.train()
    _same(_rows(thread.run_dir), _rows(cfg.output_dir))
    _same_weights(checkpoint_weights(thread.run_dir, 4), checkpoint_weights(cfg.output_dir, 4))


@pytest.mark.parametrize("kind", ["episodes", "agent", "lora"])
def test_episodes_and_lora_train_on_a_server_as_in_process(kind, make_config, model_dir, servers):
    # Multi-turn episodes (up to 3 turns of 4 tokens: every turn is a request to a server), an
    # agent's sessions (each call of its OpenAI client a request), or a LoRA policy (its merged
    # weights are pushed): the numbers of the in-process engine.
    if kind in ("episodes", "agent"):
        source = (
            {"env": {"name": "tests.envs.test_training:Echo"}}
            if kind == "episodes"
            else {"agent": {"function": "tests.envs.test_agent_training:digits_agent"}}
        )
        sections = dict(**source, reward={"functions": []}, rollout={"max_turns": 3, "max_new_tokens": 4})
    else:
        sections = dict(model={"name": model_dir, "lora": {"rank": 4, "alpha": 8}})
    runs = {}
    for engine, extra in (("vllm", {"vllm_kv_cache_gb": 0.05}), ("server", {"servers": servers[:1]})):
        rollout = {**sections.get("rollout", {}), "engine": engine, **extra}
        fields = {**sections, "model": sections.get("model", {"name": model_dir}), "rollout": rollout}
        cfg = make_config(f"{kind}-{engine}", steps=3, **fields)
        run = Run(cfg)
        run.train()
        runs[engine] = run
    _same(_rows(runs["vllm"].run_dir), _rows(runs["server"].run_dir))
    if kind in ("episodes", "agent"):
        assert _rows(runs["server"].run_dir)[-1]["episode/turns_mean"] > 1.0


def test_torchrun_ranks_share_the_servers_and_train_what_one_process_does(
    model_dir, servers, rewards_py, tmp_path
):
    # Rank 0 pushes the weights and tells every rank the version; each rank samples its own
    # prompts on the servers. Two ranks agree with one process as the in-process engines do
    # (tests/parallel/test_distributed.py: the same samples, the loss summed in another order).
    from tests.parallel.test_distributed import assert_two_ranks_train_as_one

    trees = {}
    for name in ("one", "two"):
        tree = tiny_overrides(model_dir, f"{rewards_py}:length_fraction", tmp_path / name)
        tree["num_threads"] = 1
        tree["rollout"] = {**tree["rollout"], "engine": "server", "servers": list(servers)}
        trees[name] = tree
    assert_two_ranks_train_as_one(trees, tmp_path)


class _Proxy(BaseHTTPRequestHandler):
    """Forwards every request to ``target``; once ``fail_after`` generations have passed, drops
    each generation's connection without an answer (a server that died mid-step)."""

    target = ""
    fail_after = 10**9
    generations = 0

    def log_message(self, *args):
        pass

    def _forward(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))) if method == "POST" else None
        if self.path == "/inference/v1/generate":
            type(self).generations += 1
            if type(self).generations > type(self).fail_after:
                self.close_connection = True
                return  # no answer: the client sees the connection closed
        request = urllib.request.Request(
            type(self).target + self.path,
            data=body,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, data = response.status, response.read()
        except urllib.error.HTTPError as err:
            status, data = err.code, err.read()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._forward("GET")

    def do_POST(self):
        self._forward("POST")


def test_a_server_lost_mid_run_stops_it_with_its_steps_saved_and_resume_finishes_it(
    make_config, model_dir, servers
):
    handler = type("Proxy", (_Proxy,), {"target": servers[0], "fail_after": 4})  # dies in step 3
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    try:
        sections = dict(steps=4, model={"name": model_dir}, rollout={"engine": "server", "servers": [url]})
        straight = Run(
            make_config("straight", **{**sections, "rollout": {"engine": "server", "servers": servers[:1]}})
        )
        straight.train()
        cfg = make_config("lost", save_every=10, **sections)  # no periodic save before the loss
        run = Run(cfg)
        with pytest.raises(
            ServerError, match=rf"no rollout server can sample: rollout server {url}: RemoteDisconnected"
        ):
            run.train()
        # the last completed step was saved on the way out: nothing finished is lost
        assert os.path.isdir(os.path.join(cfg.output_dir, "checkpoints", "step_2"))
        handler.fail_after = 10**9  # the server is back
        resumed = Run(cfg, resume_from=cfg.output_dir)
        assert resumed.trainer.step_idx == 2
        resumed.train()
        _same(_rows(straight.run_dir), _rows(cfg.output_dir))
        _same_weights(checkpoint_weights(straight.run_dir, 4), checkpoint_weights(cfg.output_dir, 4))
    finally:
        proxy.shutdown()
