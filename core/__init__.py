"""radixlm.core."""
