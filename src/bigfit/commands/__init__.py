"""What `bigfit train` (train.py), `bigfit plan` (plan.py, calibrate.py) run once parsed, and
micro-batch auto's launcher side (autobatch.py)."""
