"""What every layer uses: the launcher's process protocol (launch.py: local workers, the environment and
error files they share), the torch.distributed runtime, fault injection, deadline waits, size units
and precision (dtypes, loss scaling)."""
