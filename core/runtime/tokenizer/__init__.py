"""radixlm.core.runtime.tokenizer: tokenizer loading (HF folders and GGUF files), the encode/decode fast path
and the incremental detokenizer, shared by the engine and constrained decoding (which never imports
core.runtime.models). Import the submodules: this package imports nothing, so importing the fast path stays
free of the loader's dependencies."""
