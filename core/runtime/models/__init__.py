"""radixlm.core.runtime.models."""
