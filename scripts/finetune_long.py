#!/usr/bin/env python
"""Long-context fine-tuning with hyscale_hf (also installed as the ``hyscale-finetune-long`` command).

    python scripts/finetune_long.py            # SmolLM2-135M converted to DSA, offline
    python scripts/finetune_long.py --help     # every option, and the presets' values

The logic lives in ``hyscale_hf/recipes/finetune_long.py`` (install the package first:
``bash scripts/install.sh``). Exit status: 0 on success, 2 for bad arguments, 128 + the signal number
when SIGTERM or Ctrl-C stopped the run after writing a checkpoint.
"""

import sys

from hyscale_hf.recipes.finetune_long import main

if __name__ == "__main__":
    sys.exit(main())
