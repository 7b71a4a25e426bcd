"""Transformers glue: one module per model family, each registering itself with
``hyscale_hf.patching.register_family``. The only part of hyscale_hf that imports transformers
internals. Families missing from the installed Transformers are skipped at import.

Dense families (indexer added): glm4, llama, mistral, qwen2, qwen3. DSA families (MLA + lightning
indexer): axk2, deepseek_v32, dots3_note, glm_moe_dsa, hy_v4, mistral_large4.
"""

from . import (  # noqa: F401  (importing a family registers it)
    axk2,
    deepseek_v32,
    dots3_note,
    glm4,
    glm_moe_dsa,
    hy_v4,
    llama,
    mistral,
    mistral_large4,
    qwen2,
    qwen3,
)
