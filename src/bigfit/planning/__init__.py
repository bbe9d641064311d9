"""Planning: pure functions from (model description, hardware, job) to per-strategy memory and time,
a ranked list and a recommendation. No processes are started and no weights are read."""
from .search import Job, Plan, plan

__all__ = ["Job", "Plan", "plan"]
