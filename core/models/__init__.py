"""radixlm.core.models."""
