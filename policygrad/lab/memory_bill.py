"""The lines of a memory bill (:class:`MemoryItem`: one model's weights, gradients and optimiser
state, as trainable, frozen, shared or sharded) and the bill of one configuration
(:class:`MemoryPlan`), as :func:`policygrad.lab.memory_plan.plan_memory` prices them (the
accounting: :mod:`policygrad.lab.memory`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from policygrad.parallel.footprint import ModelShape, format_gb
from policygrad.parallel.run_memory import MemoryItem

__all__ = [
    "BYTES_FP32",
    "BYTES_FROZEN",
    "BYTES_TRAINABLE",
    "SHARDED",
    "STRATEGIES",
    "MemoryItem",
    "MemoryPlan",
    "format_count",
    "model_items",
    "reference_item",
    "sharded_item",
    "unsharded_copy_item",
]


# distributed.strategy's choices with several processes (the planner prices one without building it)
STRATEGIES = ("ddp", "fsdp")
SHARDED = STRATEGIES[1]  # parameters, gradients and AdamW state split over the ranks

BYTES_TRAINABLE = 16
"""Bytes per trainable parameter as the trainer holds it (``model.precision`` fp32 or bf16-mixed):
fp32 weight 4 + fp32 gradient 4 + Adam m 4 + Adam v 4 (bf16 copies exist only for compute)."""
BYTES_FROZEN = 2
"""Bytes per frozen parameter: the bf16 weight."""


BYTES_FP32 = 4
"""Bytes per parameter of a float32 copy."""


@dataclasses.dataclass
class MemoryPlan:
    """The bill of one configuration.

    Fields:
        algorithm, lora_rank, batch, seq_len, inference_engine, reward_model, reference: the inputs.
        shape: the model's :class:`ModelShape` (``linear_shapes`` dropped from ``to_dict``).
        items: the lines of the bill.
        state_bytes: weights, gradients and optimiser state of every model (ZeRO's "model
            states", Rajbhandari et al. 2019, section 3.1).
        total_bytes: ``state_bytes`` + KV cache + logits.
        world_size, strategy: the ranks and how models are spread over them (every figure is
            per rank).
        sft_state_bytes: ``state_bytes`` of supervised fine-tuning of the same model (policy only,
            same LoRA setting).
        ratio_to_sft: ``state_bytes / sft_state_bytes``.
        table: the text table printed by the CLI.
        json_path, png_path: files written (None from :func:`plan_memory` alone).
        servers: rollout server processes apart from the trainer (``rollout.engine: server``).
        server_items: one server's lines (its copy of the weights, its share of the KV cache);
            every server holds as much. Not in ``items`` or ``total_bytes``: other processes, often
            other devices or hosts.
    """

    algorithm: str
    lora_rank: int
    batch: int | None
    seq_len: int | None
    inference_engine: bool
    reward_model: bool
    reference: bool
    shape: ModelShape
    items: list[MemoryItem]
    state_bytes: int
    total_bytes: int
    sft_state_bytes: int
    ratio_to_sft: float
    world_size: int = 1
    strategy: str = "ddp"
    table: str = ""
    json_path: str | None = None
    png_path: str | None = None
    value_rollout_sequences: int = 0
    value_rollout_tokens: int = 0
    servers: int = 0
    server_items: list[MemoryItem] = dataclasses.field(default_factory=list)

    def item(self, component: str) -> MemoryItem:
        """The item named ``component``.

        Raises:
            KeyError: no such item (lists the present ones).
        """
        for it in self.items:
            if it.component == component:
                return it
        raise KeyError(f"no item {component!r}; items: {[it.component for it in self.items]}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the shape without its list of linear layers)."""
        d = dataclasses.asdict(self)
        d["shape"].pop("linear_shapes", None)
        d["shape"].pop("param_rows", None)
        d.pop("table", None)
        if not self.value_rollout_sequences:  # only VinePPO samples them
            d.pop("value_rollout_sequences")
            d.pop("value_rollout_tokens")
        d["state_gb"] = self.state_bytes / 1e9
        d["total_gb"] = self.total_bytes / 1e9
        d["sft_state_gb"] = self.sft_state_bytes / 1e9
        return d


def model_items(name: str, params: int, trainable: bool, lora: int, note: str = "") -> list[MemoryItem]:
    """Lines of one model: a full model (16 or 2 B/param), or a LoRA model (frozen base + adapters)."""
    if trainable and lora:
        return [
            MemoryItem(
                f"{name} (base)",
                "frozen",
                params,
                BYTES_FROZEN,
                params * BYTES_FROZEN,
                "LoRA: base weights frozen, bf16",
            ),
            MemoryItem(
                f"{name} (LoRA adapters)",
                "trainable",
                lora,
                BYTES_TRAINABLE,
                lora * BYTES_TRAINABLE,
                "r * (in + out) per targeted linear layer",
            ),
        ]
    if trainable:
        return [
            MemoryItem(
                name,
                "trainable",
                params,
                BYTES_TRAINABLE,
                params * BYTES_TRAINABLE,
                note or "fp32 weights + fp32 grads + 2 fp32 Adam moments",
            )
        ]
    return [MemoryItem(name, "frozen", params, BYTES_FROZEN, params * BYTES_FROZEN, note or "bf16 weights")]


def reference_item(params: int, lora: int) -> MemoryItem:
    """The reference: with LoRA the policy's base (no copy), else a float32 copy."""
    if lora:
        return MemoryItem(
            "reference", "shared", params, 0, 0, "the policy's frozen base with the adapters switched off"
        )
    return MemoryItem(
        "reference",
        "frozen",
        params,
        BYTES_FP32,
        params * BYTES_FP32,
        "frozen copy of the initial policy, float32 like the master weights",
    )


def unsharded_copy_item(params: int, inference_engine: bool) -> MemoryItem:
    """fsdp's whole float32 policy: on the device for the hf engine, in host memory with vLLM."""
    if not inference_engine:
        return MemoryItem(
            "unsharded copy",
            "frozen",
            params,
            BYTES_FP32,
            params * BYTES_FP32,
            "fsdp: the float32 policy the hf engine samples from and exports are written from",
        )
    return MemoryItem(
        "unsharded copy",
        "host",
        params,
        0,
        0,
        f"fsdp with vLLM: the float32 policy for exports and weight pushes, "
        f"{format_gb(params * BYTES_FP32)} GB of CPU memory, not on the device",
    )


_SHARDED = ("policy", "reference", "critic")  # what the trainer's fsdp strategy shards


def sharded_item(item: MemoryItem, shape: ModelShape, world_size: int) -> MemoryItem:
    """``item`` as one of ``world_size`` FSDP ranks holds it: 1/N of each parameter's rows (the
    first dimension padded to a multiple of N, as ``fully_shard`` pads, when the parameter shapes
    are known; LoRA adapters and given sizes are divided evenly)."""
    if item.component.split(" (")[0] not in _SHARDED or not item.bytes:
        return item
    full = item.params
    local = -(-full // world_size)
    if shape.param_rows and full == shape.params and "LoRA" not in item.component:
        local = sum(-(-rows // world_size) * (numel // rows) for rows, numel in shape.param_rows)
    return dataclasses.replace(
        item,
        bytes=local * item.bytes_per_param,
        note=f"{item.note}; sharded {world_size} ways: {format_count(local)} params on this rank",
    )


def format_count(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)
