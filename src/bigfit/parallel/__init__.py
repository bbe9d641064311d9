"""The parallel layout of a job: the plan (layout/plan.py, pure), the device mesh built from it (layout/mesh.py),
and the transforms that apply it to an unmodified model in one order (apply.py)."""
from ..layout.plan import ALIASES, DIMS, ParallelPlan, plan_for

__all__ = ["ALIASES", "DIMS", "ParallelPlan", "plan_for"]
