"""radixlm.kernels."""
