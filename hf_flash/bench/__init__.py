"""Benchmarks: ``python -m hf_flash.bench kernels [--mode fwd,bwd,fwdbwd] [--quick] [--out DIR]``."""
