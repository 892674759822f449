"""CUDA extension kernels, each beside its pure-PyTorch reference (installed as draftsmith_kernels).

Import the kernel modules themselves, e.g. `from draftsmith_kernels.soft_ce import soft_ce`.
"""
