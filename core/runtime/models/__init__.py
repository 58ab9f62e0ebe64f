"""Model classes and checkpoints: the architectures (registry.py), HF folders, GGUF files and hub ids
(loader.py, gguf_checkpoint.py, hub.py), and the tensor-parallel layers (parallel.py)."""
