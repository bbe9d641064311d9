"""The transforms that apply a job's parallel plan to an unmodified model, in one order (apply.py), above
every engine. The plan itself and its mesh are pure layout (layout/plan.py, layout/mesh.py), re-exported here."""
from ..layout.plan import ALIASES, DIMS, ParallelPlan, plan_for

__all__ = ["ALIASES", "DIMS", "ParallelPlan", "plan_for"]
