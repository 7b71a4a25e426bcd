"""Helpers shared by the benchmark scripts (and the tests that check them): ``timing`` (CUDA-event
timing), ``inputs`` (realistic selections and indexer-loss tensors) and ``glm5`` (the GLM-5-shaped
model stacks; Transformers is imported only when a model is built)."""
