"""radixlm.core.runtime."""
