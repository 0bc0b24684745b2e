"""`python3 benchmarks/gpu_check.py ...`: the same as `python3 benchmarks/gpu_check ...` (the
package `gpu_check/` beside this file; its `__init__.py` says what the check does), run by
`gpu_check/supervise.py` in a child process started again after a crash or hang."""

import sys

from gpu_check.supervise import main  # this folder is on the path: the package, not this file

if __name__ == "__main__":
    sys.exit(main())
