#!/usr/bin/env python
"""Long-context fine-tuning with hyscale_hf (also installed as the ``hyscale-finetune-long`` command).

    python scripts/finetune_long.py            # offline demo on a small GLM-5-architecture model
    python scripts/finetune_long.py --help     # every option

The logic lives in ``hyscale_hf/recipes/finetune_long.py``.
"""

import sys
from pathlib import Path

try:
    from hyscale_hf.recipes.finetune_long import main
except ImportError:  # run from a source checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from hyscale_hf.recipes.finetune_long import main

if __name__ == "__main__":
    main()
