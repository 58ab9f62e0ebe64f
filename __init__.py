"""radixlm: a fast runtime for structured language-model programs."""

__version__ = "0.1.0"
