"""Planning: pure functions from (model description, hardware, job) to per-strategy memory and time,
a ranked list and a recommendation. No processes are started and no weights are read.

Entry points: search.py (`plan`, `plan_for_config`), job.py (`Workload`), commands/plan.py (`bigfit plan`).
Nothing is imported here, so that planning/automap.py, which the cost modules build on, can import
planning.workload without loading the search above it."""
