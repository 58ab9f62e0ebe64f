"""radixlm.core.constrained."""
