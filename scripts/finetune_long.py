#!/usr/bin/env python
"""Long-context fine-tuning with hyscale_hf (also installed as the ``hyscale-finetune-long`` command).

    python scripts/finetune_long.py            # offline demo on a small GLM-5-architecture model
    python scripts/finetune_long.py --help     # every option

The logic lives in ``hyscale_hf/recipes/finetune_long.py``.
"""

from hyscale_hf.recipes.finetune_long import main

if __name__ == "__main__":
    main()
