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
RELEASES=(0.11.2 0.12.0.1)
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=("${RELEASES[@]}")

# What differs between JAX releases, in a few minutes per release: JAX's internals and Mosaic
# GPU's API (the compat modules), the native kernels in the interpreter and traced for CUDA,
# the max-combining state under grad/vmap/scan, numerics, the train step, Flax NNX, and the
# deviceless H100 compiles of fp8jax.inspect. A test renamed here fails loudly (not found).
TESTS=(
    tests/test_jax_private.py
    tests/test_mosaic_private.py
    tests/test_max_not_sum.py
    # Trace-time settings as JAX user contexts (in the cache keys, carried across threads).
    tests/test_contexts.py
    tests/test_train_step.py::test_matches_the_explicit_step
    tests/test_train_step.py::test_compiles_with_fp8jax_s_gpu_options_by_default
    tests/test_train_step.py::test_gpu_options_as_flags_are_accepted_by_xla
    tests/test_train_step.py::test_bfloat16_compute_keeps_float32_masters_and_state
    tests/test_kernels.py::test_kernel_matches_float64_reference_in_the_interpreter
    # The persistent warp-specialized kernel: wgmma on a transposed view runs in 0.11+'s
    # interpreter (on 0.10.2 it is refused), and its deviceless H100 PTX.
    tests/test_persistent_gemm.py
    tests/test_kernels.py::test_cpu_compiles_keep_the_xla_path
    # The one-pass quantization kernels (Pallas Triton): interpreted, and their deviceless
    # H100 lowering (from 0.11 on it reads its target from the abstract mesh).
    tests/test_block_quantize.py
    # The expert layer's gradient in one kernel (a scatter of rows), interpreted (session 38).
    tests/test_padded_quantize.py::test_rows_and_padded_columns_match_numpy_in_one_kernel
    tests/test_padded_quantize.py::test_blockwise_expert_layer_trains_as_its_xla_path_with_the_gathering_kernels
    tests/test_grouped_native.py::test_rows_kernel_matches_float64_in_the_interpreter
    tests/test_grouped_native.py::test_tokens_kernel_matches_float64_in_the_interpreter
    tests/test_grouped_native.py::test_cpu_compiles_keep_the_xla_path
    # E5M2 gradients times E4M3 weights in one wgmma (0.11 on), interpreted.
    "tests/test_grouped_native.py::test_layer_on_the_kernels_matches_its_xla_path[delayed]"
    tests/test_numerics.py::test_bf16_outputs_carry_no_scale_bias
    tests/test_numerics.py::test_dgrad_kernel_is_one_rounding_of_the_weight
    tests/test_lowering.py::test_every_recipe_lowers_to_fp8_gemms_only
    # XLA's cuBLAS rewriter taking the kept inverses as cuBLASLt's own scales.
    tests/test_lowering.py::test_kept_inverses_cost_no_kernel_in_cublas_mode
    # ... and XLA's dot merger, which made BF16 GEMMs of GEMMs sharing a weight (session 44).
    tests/test_lowering.py::test_gemms_sharing_a_weight_stay_fp8_in_the_steady_train_step_on_h100
    tests/test_train_step.py::test_steps_traced_for_cublas_compile_without_the_dot_merger
    # The transposed FP8 copies apart: the casts reduce the amaxes (issue 38, session 35).
    tests/test_lowering.py::test_transposes_apart_let_the_cast_reduce_the_amax_on_h100
    tests/test_lowering.py::test_transposes_apart_takes_roles
    # The per-tensor one-pass kernel in a step: interpreted, and on a deviceless H100
    # (session 40; the GPU runs 0.11).
    tests/test_cast_transpose.py
    # ... and on TMA and the tensor cores (Mosaic GPU: wgmma on a transposed view, 0.11 on).
    tests/test_tensor_core_transpose.py
    tests/test_tensor_core_gathered.py
    tests/test_lowering.py::test_cast_transpose_kernel_quantizes_each_operand_in_one_pass_on_h100
    # fp8jax.inspect reading a Mosaic GPU kernel's PTX (the GPU's 0.11 lowers no
    # Mosaic `pallas_call`: the test's kernel is a `plgpu.kernel` there).
    tests/test_inspect.py::test_pallas_mosaic_gpu_kernels_are_judged_by_their_ptx
    # The cost model of XLA's asynchronous fusions (0.11 on: a loop's dynamic slices).
    "tests/test_cost.py::test_fp8_linear_step_runs_three_fp8_gemms_worth_of_flops[blockwise]"
    tests/test_nnx.py::test_every_recipe_matches_the_equinox_path_bit_for_bit
    tests/test_nnx.py::test_an_nnx_jit_step_runs_every_targeted_gemm_in_fp8_on_h100
    # A step's program traced once for both modes where no mode changes it (session 47).
    tests/test_inspect.py::test_a_train_step_is_lowered_once_for_both_modes_where_they_trace_it_alike
    # The NNX step's two programs, traced and inspected as the step compiles them (session 45).
    tests/test_nnx.py::test_train_step_is_inspected_as_it_compiles_both_its_programs
    "tests/test_nnx.py::test_train_step_drops_the_warm_start_once_every_scale_is_recorded[cublas-mode]"
    # The high-precision grouped GEMM, a primitive of fp8jax's (core/jax_primitive.py), under
    # every transform.
    tests/test_grouped.py::test_a_high_precision_grouped_linear_takes_every_derivative
    tests/test_grouped.py::test_a_jitted_high_precision_grouped_linear_maps_and_differentiates_in_any_order
    tests/test_grouped.py::test_a_high_precision_grouped_linear_compiles_to_lax_ragged_dot
    tests/test_grouped.py::test_fp8_autocast_answers_a_high_precision_grouped_linear_s_gemm
    # fp8_autocast reinterprets jaxprs: primitives' names, bind parameters, sub-jaxprs.
    tests/test_autocast.py::test_control_flow_matches_the_module_path
    tests/test_autocast.py::test_the_selection_by_scope_batch_and_size
    tests/test_autocast.py::test_ragged_dot_becomes_the_grouped_fp8_gemm
    # Flax Linen's interception, against the Equinox path and Flax's own FP8 op.
    "tests/test_linen.py::test_every_recipe_matches_the_equinox_path_bit_for_bit[delayed]"
    tests/test_linen.py::test_delayed_scaling_matches_flax_fp8_direct_dot_general
    # The kernels per shard: custom_partitioning, its Shardy rule and the shardings JAX hands
    # the rule (jax_private.spec_of), on 8 CPU devices and on a compile for 8 H100s.
    # Then the kernels interpreted on every device's shards as the partitioner decided, and
    # each device's GEMM traced in the caller's context (on XLA's compile thread).
    "tests/test_scaling_out.py::test_native_kernels_per_shard_train_like_one_device[blockwise-tensor]"
    tests/test_scaling_out.py::test_each_devices_gemm_is_traced_in_the_callers_context
    "tests/test_scaling_out.py::test_grouped_gemms_per_shard_train_like_one_device[blockwise-data]"
    "tests/test_scaling_out.py::test_an_fsdp_weight_gathers_as_fp8_on_eight_h100s[blockwise]"
    # The gathered FP8 weight as a value (partition.gathered_for: its own Shardy factors).
    tests/test_scaling_out.py::test_a_scan_over_fsdp_layers_trains_like_one_device
    # Expert parallelism: ragged_all_to_all (emulated on CPU through platform_dependent) and
    # the manual axes' types of shard_map, traced for CUDA and run on 8 CPU devices.
    tests/test_expert_parallel.py::test_the_cpu_exchange_is_ragged_all_to_all
)
# The longest of them (compiles for 8 H100s, 40-90 s each), on the newest release only: a
# change of JAX's sharding internals shows there first, and CI keeps its time.
NEWEST_ONLY=(
    tests/test_scaling_out.py::test_a_scan_over_layers_gathers_each_fp8_weight_once
    "tests/test_expert_parallel.py::test_expert_parallel_moe_trains_like_one_device[blockwise-data 2 x expert 4]"
    tests/test_expert_parallel.py::test_the_dispatch_moves_fp8_on_eight_h100s
    # The mixed-FP8 wgmma in a MoE step's PTX (e5m2.e4m3), compiled for an H100.
    tests/test_grouped_native.py::test_h100_e5m2_gradients_run_dgrad_and_wgrad_in_fp8_where_wgmma_takes_the_pair
    # Collectives as the inspector reads them (0.11 types an async all-reduce's start as
    # (operands, results)): FP8 moves no more than BF16 under FSDP on 8 H100s. With the 8-H100
    # steps above it compiles the native kernels in train steps on the newer releases (the
    # one-H100 train step of tests/test_kernels.py runs in the README's command only: CI time,
    # session 48).
    tests/test_scaling_out.py::test_fsdp_runs_the_native_kernels_and_moves_no_more_than_bf16
)
# On the release the lent GPUs run only: the GPU check itself (benchmarks/gpu_check.py: its
# MoE yardstick, JAX's own BF16 grouped kernels behind a custom VJP; its profile reading,
# jax.profiler.ProfileData; its kernels section's dry run), and the H100 fusion of the train
# step's finite check of its new FP8 states (one reduction, session 45).
GPU_RELEASE=0.11.2
GPU_RELEASE_ONLY=(
    tests/test_train_step.py::test_fp8_states_are_checked_finite_together_on_h100
    tests/test_gpu_check.py::test_jax_grouped_bf16_computes_the_moe_step_as_lax_ragged_dot
    tests/test_gpu_check.py::test_profile_reads_a_trace_through_jax_profile_data
    tests/test_gpu_check.py::test_profile_reads_kernels_of_a_device_plane_without_stream_lines
    tests/test_gpu_check.py::test_profile_section_on_a_gpu_trace
)
GPU_RELEASE_DRY_RUN=tests/test_persistent_gemm.py::test_the_gpu_checks_kernels_section_runs_dry
# ... and a whole expert layer's step inside choice.tensor_core_quantization() (its wiring of
# the Mosaic GPU kernels, each of which runs on every release in its own file; session 54).
GPU_RELEASE_LAYER=tests/test_tensor_core_gathered.py::test_blockwise_expert_layer_on_the_tensor_cores_trains_as_on_the_triton_kernels
# The per-tensor kernel's recipe matrix on BF16 operands only here (float32 runs in the README's
# command; session 51, for CI time: the tensor-core kernel's tests took its place).
FLOAT32_MATRIX=tests/test_cast_transpose.py::test_per_tensor_recipes_quantize_in_one_pass_as_their_xla_path
# --deselect ignores a name it does not find: a renamed test fails here instead.
for test in "$GPU_RELEASE_DRY_RUN" "$GPU_RELEASE_LAYER" "$FLOAT32_MATRIX"; do
    grep -q "^def ${test##*::}(" "${test%%::*}" || {
        echo "tests/other_jax.sh: $test not found" >&2
        exit 2
    }
done
NEWEST=${RELEASES[-1]}

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
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import jax, xdist, sys; sys.exit(jax.__version__ != '$v')"; then
        rm -rf "$venv"
        "$PYTHON" -m venv "$venv"
        "$venv/bin/pip" install -q --no-compile -e ".[nnx]" "jax==$v" "jaxlib==$v" \
            "jax-cuda12-plugin==$v" "jax-cuda12-pjrt==$v" \
            "pytest>=8" "pytest-xdist>=3.6" "hypothesis>=6.100" "optax==0.2.8"
    fi
    installed=$SECONDS
    if [ $INSTALL_ONLY = 1 ]; then
        echo "jax $v: install $((installed - start)) s"
        continue
    fi
    # The notebooks run in the main command: addopts without --nbmake.
    run=("${TESTS[@]}" --deselect "$FLOAT32_MATRIX[float32")
    [ "$v" != "$NEWEST" ] || run+=("${NEWEST_ONLY[@]}")
    if [ "$v" = "$GPU_RELEASE" ]; then
        run+=("${GPU_RELEASE_ONLY[@]}")
    else
        run+=(--deselect "$GPU_RELEASE_DRY_RUN" --deselect "$GPU_RELEASE_LAYER")
    fi
    "$venv/bin/python" -m pytest -q -n 2 --dist worksteal -o addopts="-m 'not slow'" "${run[@]}"
    echo "jax $v: install $((installed - start)) s, tests $((SECONDS - installed)) s"
done
