#!/usr/bin/env python
"""Same as ``python -m parallel3d.train``: ``python scripts/pretrain.py [key=value ...]``
(or ``torchrun --nproc-per-node N scripts/pretrain.py ...``). See parallel3d/train.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.train import main  # noqa: E402

if __name__ == "__main__":
    main()
