"""Helpers shared by the benchmark scripts (and the tests that check them): ``timing`` (CUDA-event
timing), ``inputs`` (realistic selections and indexer-loss tensors), ``stacks`` (the GLM-5- and
SmolLM2-shaped model stacks; Transformers is imported only when a model is built), ``memory`` (device
and pinned-host figures, out-of-memory handling), ``selections`` (the selections a model's forward
makes, and how much neighbouring queries share them) and ``cli`` (argument checks)."""
