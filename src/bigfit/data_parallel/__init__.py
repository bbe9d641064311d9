"""Data parallelism: FSDP2 and DDP + ZeRO-1 (sharding.py), zero3-offload's streamed host steps (streamed.py)."""
