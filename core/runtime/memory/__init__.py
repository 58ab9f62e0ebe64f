"""KV memory: the radix cache, its host-memory tier, the token-paged KV pool."""
