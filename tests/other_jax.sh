#!/usr/bin/env bash
# Run fp8jax's version-sensitive tests on the newer JAX releases it supports (README's main
# test command covers jax 0.10.2 on Python 3.11). One Python 3.12 venv per release under
# .venv-jax/, with the CUDA plugin of that exact release for the deviceless H100 compiles.
#
#   bash tests/other_jax.sh              # every release below
#   bash tests/other_jax.sh 0.12.0.1     # one of them
#   bash tests/other_jax.sh --install    # only make the venvs (CI, while the main suite runs)
#   PYTHON312=/path/to/python3.12 bash tests/other_jax.sh
set -euo pipefail
cd "$(dirname "$0")/.."

INSTALL_ONLY=0
if [ "${1:-}" = --install ]; then
    INSTALL_ONLY=1
    shift
fi
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.11.2 0.12.0.1)

# What differs between JAX releases: JAX's internals and Mosaic GPU's API (the compat
# modules), the kernels in the interpreter and traced for CUDA, the train step, numerics,
# Flax NNX, and the deviceless H100 compiles.
TESTS=(
    tests/test_jax_private.py
    tests/test_mosaic_private.py
    tests/test_kernels.py
    tests/test_grouped_native.py
    tests/test_train_step.py
    tests/test_numerics.py
    tests/test_max_not_sum.py
    tests/test_lowering.py
    tests/test_inspect.py
    tests/test_nnx.py
)

find_python312() {
    local candidates=("${PYTHON312:-}" python3.12 /root/.pyenv/versions/3.12.*/bin/python3)
    for c in "${candidates[@]}"; do
        [ -n "$c" ] || continue
        if "$c" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null; then
            command -v "$c" || echo "$c"
            return
        fi
    done
    echo "tests/other_jax.sh: no Python 3.12 found (tried python3.12 and pyenv's 3.12);" \
        "set PYTHON312 to one (jax 0.11 and later need Python 3.12+ here)." >&2
    exit 2
}

PYTHON=$(find_python312)
for v in "${VERSIONS[@]}"; do
    venv=".venv-jax/$v"
    start=$SECONDS
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import jax, sys; sys.exit(jax.__version__ != '$v')"; then
        rm -rf "$venv"
        "$PYTHON" -m venv "$venv"
        "$venv/bin/pip" install -q --no-compile -e ".[nnx]" "jax==$v" "jaxlib==$v" \
            "jax-cuda12-plugin==$v" "jax-cuda12-pjrt==$v" \
            "pytest>=8" "hypothesis>=6.100" "optax==0.2.8"
    fi
    installed=$SECONDS
    if [ $INSTALL_ONLY = 1 ]; then
        echo "jax $v: install $((installed - start)) s"
        continue
    fi
    # The notebooks run in the main command: addopts without --nbmake.
    "$venv/bin/python" -m pytest -q -o addopts="-m 'not slow'" "${TESTS[@]}"
    echo "jax $v: install $((installed - start)) s, tests $((SECONDS - installed)) s"
done
