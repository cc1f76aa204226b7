"""The trainer's side of a rollout server's HTTP routes (vLLM's API server started by
:mod:`policygrad.rollout.serve`): JSON requests with a timeout and named errors, and one weight
update through the routes and a gloo transfer group (:mod:`policygrad.rollout.transfer`)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from policygrad.errors import TrainingError
from policygrad.rollout.transfer import GlooTransferEndpoint, broadcast_options, route_source

__all__ = [
    "ServerError",
    "ServerRequestError",
    "connect",
    "describe",
    "healthy",
    "post",
    "push",
    "transfer_address",
]


class ServerError(TrainingError):
    """A rollout server that failed, and no other server to take its work (a run stops with its
    last completed step saved and this one line)."""


class ServerRequestError(ServerError):
    """A request the server refused as malformed (HTTP 400): every server would refuse it."""


def post(url: str, path: str, body: dict | None, timeout_s: float) -> dict:
    """POST JSON to ``url + path``; the answer's JSON. Raises ServerError with the server's own
    error text on an error status, OSError (URLError, timeout) when it cannot be reached."""
    data = json.dumps(body if body is not None else {}).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        try:
            detail = json.loads(detail).get("error", {}).get("message", detail)
        except (ValueError, AttributeError):
            pass
        error = ServerRequestError if err.code == 400 else ServerError
        raise error(f"{url}{path} answered {err.code}: {detail}") from err
    return json.loads(text) if text else {}


def describe(err: BaseException) -> str:
    """What went wrong with a request, in a few words (a timeout says so, whichever timer fired:
    the HTTP request's, or the process-group store's while the server never joined the push,
    ``DistStoreError: wait timeout``, which wins under load)."""
    if isinstance(err, (TimeoutError, socket.timeout)) or any(
        words in str(err) for words in ("timed out", "wait timeout")
    ):
        return "no answer within the timeout"
    reason = getattr(err, "reason", None)
    return f"{type(err).__name__}: {reason if reason is not None else err}"


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url``/health answers 200 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return False


def transfer_address(url: str) -> str:
    """The address of this machine that ``url``'s host reaches it at."""
    return route_source(urllib.parse.urlparse(url).hostname or "127.0.0.1")


def connect(url: str, address: str | None, timeout_s: float) -> GlooTransferEndpoint:
    """A transfer group with the server at ``url`` (``/init_weight_transfer_engine`` while this
    process joins as rank 0); ``address``: where the server reaches this process (None: the
    route's source address)."""
    endpoint = GlooTransferEndpoint(address or transfer_address(url), timeout_s)
    init_info = endpoint.open()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(post, url, "/init_weight_transfer_engine", {"init_info": init_info}, timeout_s)
        try:
            endpoint.connect()
        except RuntimeError:
            if future.done():
                future.result()  # the server's own error says more
            raise
        future.result()
    return endpoint


def _broadcast_all(endpoint: GlooTransferEndpoint, weights, update_call, deadline: float) -> None:
    """Broadcast every tensor to the server, polling so that a server that gave up receiving
    (``update_call`` done, with its error) or the ``deadline`` ends the send at once."""
    group, options = endpoint.group, broadcast_options()
    for _, tensor in weights:
        work = group.broadcast([tensor], options)
        pause = 1e-4
        while not work.is_completed():
            if update_call.done():
                # an error: the server gave up receiving (its error, not a send timeout); an
                # answer: it has every byte, and this side's completion is on its way
                update_call.result()
                break
            if time.monotonic() > deadline:
                raise TimeoutError("weight push timed out")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        work.wait()


def push(
    url: str, endpoint: GlooTransferEndpoint, weights, update_info: dict, label: str, timeout_s: float
) -> None:
    """One weight update of the server at ``url``: ``/start_weight_update``, ``/update_weights``
    while the tensors are broadcast, ``/reset_prefix_cache``, ``/finish_weight_update`` with
    ``label``, all within ``timeout_s`` together. Stops as soon as the server gives up receiving
    (its error, e.g. a CRC that differs)."""
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("weight push timed out")
        return remaining

    try:
        post(url, "/start_weight_update", None, left())
    except ServerError as err:
        if "already active" not in str(err):
            raise
        # an update this trainer abandoned (its call timed out here, then finished there):
        # finalise it (the weights keep their old label) and start anew
        post(url, "/finish_weight_update", None, left())
        post(url, "/start_weight_update", None, left())
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        future = pool.submit(post, url, "/update_weights", {"update_info": update_info}, left())
        try:
            _broadcast_all(endpoint, weights, future, deadline)
        except (RuntimeError, TimeoutError) as send_error:
            # the server's own error (a CRC that differs, ...) says more than the broken
            # connection it leaves behind: wait briefly for its answer
            try:
                future.result(timeout=min(5.0, timeout_s))
            except concurrent.futures.TimeoutError:
                pass
            raise send_error
        future.result(timeout=left())
    finally:
        pool.shutdown(wait=False)  # a stalled update call is abandoned with its group
    # KV computed under the old weights must not be reused: cleared before the new label is
    # set (vLLM's weight update leaves the prefix cache as it was)
    while not post(url, "/reset_prefix_cache", None, left()).get("success"):
        time.sleep(0.1)  # blocks still held by a request finishing (until the deadline)
    post(url, "/finish_weight_update", {"weight_version": label}, left())
