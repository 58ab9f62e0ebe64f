"""radixlm.core.runtime.layers: the types a model forward and the engine both use (ForwardBatch, the attention
backend). Models import these, never the engine above them, so the runtime's layers import downward only."""
