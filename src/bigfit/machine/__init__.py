"""The machine model: hardware descriptions, GPUs by name, and the figures measured on this machine
(calibration.py's cache: host issue cost, Adam rates, disk and CPU rates) that the planner reads."""
