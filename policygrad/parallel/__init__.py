"""Processes and devices: ranks and collectives, the distribution strategy (single, DDP, FSDP2),
sharding, precision, activation recompute and torch's thread count."""
