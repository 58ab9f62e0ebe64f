"""Running a batch on the device: the model runner, CUDA graphs, the sampler."""
