"""Kernels: a torch reference path for every op, Triton versions for GPUs."""
