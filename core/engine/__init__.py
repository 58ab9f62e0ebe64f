"""radixlm.core.engine."""
