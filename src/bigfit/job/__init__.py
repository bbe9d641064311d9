"""The job: settings checked (checks.py), resolved (resolution.py), prepared and described (prepare.py),
and what `--strategy auto` asks the planner (autoplan.py)."""
