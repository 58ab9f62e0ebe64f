"""radixlm.core.lang.backends."""
