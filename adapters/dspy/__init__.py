"""radixlm.adapters.dspy."""
