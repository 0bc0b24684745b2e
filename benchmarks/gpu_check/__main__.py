"""`python3 benchmarks/gpu_check --out DIR [--quick | --dry-run]`: see `gpu_check/__init__.py`."""

import os
import sys

# `benchmarks/` on the path: this package, and the benchmarks' shared `train_steps`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_check.supervise import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
