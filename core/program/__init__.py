"""radixlm.core.program."""
