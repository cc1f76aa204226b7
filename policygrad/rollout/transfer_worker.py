"""The server's end of :mod:`policygrad.rollout.transfer`: vLLM's worker-side weight-transfer
engine over gloo. Imported only inside a vLLM server process (it subclasses vLLM's
``WeightTransferEngine``); :func:`policygrad.rollout.transfer.register` names it in vLLM's factory."""

from __future__ import annotations

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from policygrad.rollout.transfer import (
    GlooInitInfo,
    GlooUpdateInfo,
    WeightDigestError,
    broadcast_options,
    open_group,
    register,
    tensor_digest,
)

__all__ = ["GlooWeightTransferEngine", "RegisterTransfer"]


class GlooWeightTransferEngine(WeightTransferEngine):
    """Receives tensors from the trainer (rank 0 of a two-process gloo group), checks each one's
    CRC-32 before loading it, and loads with vLLM's layerwise reload (as vLLM's ``nccl``
    engine does). A digest that differs raises :class:`WeightDigestError` naming the tensor; the
    update is then incomplete and the trainer must not sample this server until a full update
    succeeds. A failed update is finalised before its error is raised, so the next one loads."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        self.group = open_group(init_info.master_address, init_info.master_port, 1, init_info.timeout_s)

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info) -> None:
        # the base class ends with torch.accelerator.synchronize(), which the CPU build lacks;
        # gloo's wait() has already completed every receive here
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("policygrad_gloo weight transfer is not initialised; call init first")
        options = broadcast_options()
        try:
            u = update_info
            for name, dtype_name, shape, digest in zip(
                u.names, u.dtype_names, u.shapes, u.digests, strict=True
            ):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
                self.group.broadcast([tensor], options).wait()
                got = tensor_digest(tensor)
                if got != digest:
                    raise WeightDigestError(
                        f"weight {name} arrived with CRC-32 {got}, the trainer sent {digest}"
                    )
                self.model.load_weights([(name, tensor.to(self.device))])
        except BaseException:
            # The layers stay wrapped for a reload until it is finalised, and the next update
            # could not load into them: finalise now (layers that got nothing keep their old
            # tensors). The weights are then a mix; the trainer samples this server again only
            # after a whole update succeeds.
            self.group = None  # its pending sends are abandoned: the next update joins a new group
            finalize_layerwise_reload(self.model, self.model_config)
            raise

    def shutdown(self) -> None:
        self.group = None  # gloo closes its connections when the group is collected


class RegisterTransfer:
    """A vLLM worker extension (``--worker-extension-cls``) that adds nothing: naming it makes
    every vLLM worker import this module, which registers the engine, so a server runs where
    policygrad is on the path but not installed (no ``vllm.general_plugins`` entry point)."""


register()  # on import, in every process that loads this module (idempotent)
