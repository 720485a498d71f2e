"""The one compiled part of Laneplay: the low-bit CPU kernels (`kernels/lowbit.c`).

Everything else about the package is in pyproject.toml. The extension is optional: without a C
compiler the install still succeeds and the low-bit dtypes say why they are unavailable.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "laneplay.kernels._lowbit", sources=["kernels/lowbit.c"],
    extra_compile_args=["-O3", "-fopenmp", "-std=gnu11"], extra_link_args=["-fopenmp"], optional=True,
)])
