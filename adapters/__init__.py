"""radixlm.adapters."""
