"""Quantized weights (docs/quantization.md): which scheme a model runs (config), its checkpoint formats
(fp8_checkpoint), and its linear layers (fp8)."""
