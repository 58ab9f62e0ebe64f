"""radixlm.core.backends."""
