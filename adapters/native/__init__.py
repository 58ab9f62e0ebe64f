"""radixlm.adapters.native."""
