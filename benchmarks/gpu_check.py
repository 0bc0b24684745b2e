"""`python3 benchmarks/gpu_check.py ...`: the same as `python3 benchmarks/gpu_check ...` (the
package `gpu_check/` beside this file; its `__init__.py` says what the check does)."""

import sys

from gpu_check.main import main  # this folder is on the path: the package, not this file

if __name__ == "__main__":
    sys.exit(main())
