"""The offload engine (engine.py, strategy.py): host optimizer states in buckets, their formats and
reference, transfers, pinned buffers, gradient slots, the NVMe tier, the host step's measured rate."""
