"""Compute kernels behind the engine: a plain-torch reference for each op (the CPU path, and the
yardstick in tests) and, for CUDA, Triton versions beside them."""
