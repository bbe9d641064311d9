"""The pure layout a job runs under, read by the planner and the engines alike: the parallel plan
(plan.py), its device mesh (mesh.py), the pipeline cut (cut.py) and which stage owns which module
(split.py), device maps (maps.py), how activations and the loss's logits are kept (activations.py)."""
