"""Transformers glue: one module per model family, each registering itself with
``hyscale_hf.patching.register_family``. The only part of hyscale_hf that imports transformers
internals. Families missing from the installed Transformers are skipped at import."""

from . import glm4, llama, mistral, qwen2, qwen3  # noqa: F401,E402  (dense families)
# DSA families (MLA + lightning indexer); each file registers only if Transformers has the model.
from . import axk2, deepseek_v32, dots3_note, glm_moe_dsa, hy_v4, mistral_large4  # noqa: F401,E402
