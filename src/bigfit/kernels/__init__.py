"""Host kernels bigfit builds from C on first use (csrc/): the Adam step the offload engine runs."""
