"""fp8jax's one prepared device check, for a lent Hopper GPU (H100 or H200).

    PYTHONPATH=. timeout 500 python3 benchmarks/gpu_check.py --out $OUT/gpu_check [--quick]
    PYTHONPATH=. python3 benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check   # on a CPU
    PYTHONPATH=. timeout 580 python3 benchmarks/gpu_check.py --lease --out $OUT   # a lease's plan

Sections, each measurement in its own `try`, results appended to the out folder as they come
(`results.jsonl`, `log.txt`; then `decisions.txt`, `summary.txt`, `environment.json`):

1. `numerics`: every native kernel at odd shapes against float64 NumPy and the XLA path;
2. `gemms`, `grouped`: GEMM timings at LLM shapes, BF16, cuBLASLt FP8 and fp8jax's kernels
   side by side (and JAX's BF16 grouped kernels); `kernels`: the persistent warp-specialized
   block-scaled kernel (issue 39), its numerics against float64 and its tuning sweep beside
   the tiled kernel, cuBLASLt FP8 and BF16; `quantize`: the blockwise recipe's one-pass
   quantization kernels, bit for bit against IEEE NumPy and timed beside its XLA path;
3. `steps`: whole train steps, BF16 against each recipe, beside the cost model's estimate;
4. `llama`: the Llama-3-style block of `llama_block.py` (8B and 1B), BF16 against FP8 scaling,
   beside its compiled HLO's kernels, non-GEMM bytes and temp memory;
5. `profile`: the same steps traced by `jax.profiler`, device time split into FP8 and BF16
   GEMMs, attention and the rest, GPU idle and kernels per step (`profile_kernels.json`).

Then the decision inputs (which defaults the measurements would decide) and the summary
table, printed last. `--budget-s` bounds the time: each measurement starts only if enough is
left, else it is recorded as skipped. `--dry-run` runs the same code with tiny shapes on the
CPU (the kernels in Mosaic GPU's interpreter); its times mean nothing. The check runs in a
child process, started again where a measurement crashed or hung (`supervise.py`). `--lease`
runs the parts a lent GPU runs first (`lease.py`), in one call inside one deadline.
"""
