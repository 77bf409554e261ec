"""Triton kernels of fastgrpo, one op per file; installed as `fastgrpo.kernels`."""
