"""Compute kernels behind the engine: a plain-torch reference for each op (the CPU path where the
engine has one, and always the yardstick the tests check the Triton version against) and, for
CUDA, Triton versions beside them."""
