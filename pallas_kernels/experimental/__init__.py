"""Kernel variants being tried: not used by the model, not part of ``pallas_kernels``' public contract.

A variant lives here until it beats the product kernel it would replace (measured on the GPU) and
replaces it. Until then it may be slower, may take fewer shapes, and may fault the device: a device
fault (e.g. CUDA_ERROR_MISALIGNED_ADDRESS) poisons the whole process, so a GPU test of an experimental
kernel must run it in a subprocess, and benchmarks run these only when asked explicitly.
"""
