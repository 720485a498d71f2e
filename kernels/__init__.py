"""Decode-step kernels: Triton on CUDA, plain-torch references everywhere (`laneplay.kernels.ops`)."""
