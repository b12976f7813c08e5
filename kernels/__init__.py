"""Triton kernels with torch twins. Keep this file free of heavy imports: transformers probes a
top-level package named `kernels` at import time."""
