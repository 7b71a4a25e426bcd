"""Transformers glue: one module per model family, each registering itself with
``hyscale_hf.families.register_family``, the one DSA attention step every patched layer runs
(``_dsa_step``, over the visibility of ``_visibility``; patched and undone through ``_dsa_patch``),
and the Transformers checkpointing hooks of selection replay (``_checkpointing``). The only part of
hyscale_hf that knows Transformers internals.
Families missing from the installed Transformers are skipped at import.

Nothing here imports ``hyscale_hf.patching``: patching imports this package on first use to fill
the registry, so an import back would close a circle (docs/design.md section 3).

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
