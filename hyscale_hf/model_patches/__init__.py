"""Transformers glue: one module per model family, each registering itself with
``hyscale_hf.patching.register_family``. The only part of hyscale_hf that imports transformers
internals. Families missing from the installed Transformers are skipped at import."""

# DSA families (MLA + lightning indexer); each file registers only if Transformers has the model.
from . import (  # noqa: F401,E402  (dense families)  # noqa: F401,E402
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
