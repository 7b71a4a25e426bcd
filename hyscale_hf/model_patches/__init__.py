"""Transformers glue: one module per model family, each registering itself with
``hyscale_hf.patching.register_family``. The only part of hyscale_hf that imports transformers
internals. Families missing from the installed Transformers are skipped at import."""

from . import glm4, llama, mistral, qwen2, qwen3  # noqa: F401,E402  (dense families)
