"""radixlm.adapters.langchain."""
