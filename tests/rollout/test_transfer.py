"""The gloo weight transfer's trainer side (policygrad/rollout/transfer.py): digests, the update
metadata, and a loopback of the trainer's endpoint with a rank-1 group in a thread (the server's
end, as transfer_worker.py opens it; that one is run by tests/rollout/test_server.py)."""

from __future__ import annotations

import threading
import zlib

import pytest
import torch

from policygrad.rollout.transfer import (
    GlooTransferEndpoint,
    GlooUpdateInfo,
    broadcast_options,
    open_group,
    tensor_digest,
)

pytestmark = pytest.mark.unit


def test_a_digest_is_the_crc32_of_the_row_major_bytes():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_digest(t) == f"{zlib.crc32(t.numpy().tobytes()):08x}"
    # a transposed view hashes its row-major copy, so it differs from the original's digest
    assert tensor_digest(t.t()) == f"{zlib.crc32(t.t().contiguous().numpy().tobytes()):08x}"
    assert tensor_digest(t.t()) != tensor_digest(t)
    # bf16 has no numpy dtype: its bytes are hashed as they are
    b = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert tensor_digest(b) == f"{zlib.crc32(b.view(torch.int16).numpy().tobytes()):08x}"
    # one flipped bit changes it
    flipped = t.clone()
    flipped.view(torch.int32)[0, 0] ^= 1
    assert tensor_digest(flipped) != tensor_digest(t)
    assert tensor_digest(torch.empty(0)) == f"{zlib.crc32(b''):08x}"


def test_update_info_lists_every_tensor_and_refuses_lists_of_other_lengths():
    weights = [("a", torch.zeros(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    info = GlooTransferEndpoint.update_info(weights)
    assert info["names"] == ["a", "b"]
    assert info["dtype_names"] == ["float32", "bfloat16"]
    assert info["shapes"] == [[2, 3], [4]]
    assert info["digests"] == [tensor_digest(t) for _, t in weights]
    with pytest.raises(ValueError, match="update_info.digests has 1 entries, names has 2"):
        GlooUpdateInfo(names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[1], [1]], digests=["x"])


def test_the_endpoint_sends_every_tensor_to_a_joined_group_and_times_out_without_one():
    endpoint = GlooTransferEndpoint("127.0.0.1", timeout_s=10)
    info = endpoint.open()
    assert set(info) == {"master_address", "master_port", "timeout_s"} and info["master_port"] > 0
    weights = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.int64))]
    received = []

    def server():
        group = open_group(info["master_address"], info["master_port"], 1, info["timeout_s"])
        for _, t in weights:
            out = torch.empty_like(t)
            group.broadcast([out], broadcast_options()).wait()
            received.append(out)

    thread = threading.Thread(target=server)
    thread.start()
    endpoint.connect()
    endpoint.send(weights)
    thread.join(timeout=30)
    assert all(torch.equal(a, b) for (_, a), b in zip(weights, received, strict=True))

    endpoint.close()
    with pytest.raises(RuntimeError, match="not connected"):
        endpoint.send(weights)
