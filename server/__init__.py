"""radixlm.server."""
