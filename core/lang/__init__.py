"""radixlm.core.lang."""
