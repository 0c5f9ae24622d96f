"""Benchmarks: ``python -m hf_flash.bench {kernels,overhead,decode,e2e,generate} [--help]``; each appends its
rows to benchmarks/results.csv (``--no-record`` skips it)."""
