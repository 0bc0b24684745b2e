"""Native GPU kernels: the GEMMs XLA cannot express as one FP8 call (Pallas Mosaic GPU), and
the blockwise recipe's one-pass quantization (Pallas Triton, `block_quantize`,
`padded_quantize`; on TMA and the tensor cores, `tensor_core_blocks`, Mosaic GPU), and a
per-tensor one (`cast_transpose`; on TMA and the tensor cores, `tensor_core_transpose`; the
tensor-core kernels' frame: `tensor_core_tiles`; all timed by the GPU check).

Pallas is imported by the kernel modules, on use; this package's top level stays light.
"""

#: The block-scaled GEMM kernel's name: in its PTX (`<name>_mosaic_gpu_kernel`) and in the
#: HLO's op_name, where `fp8jax.hlo_cost` recognizes it as a GEMM.
BLOCK_GEMM_NAME = "fp8jax_block_scaled_gemm"

#: The grouped (mixture-of-experts) FP8 GEMM kernels' names: rows (forward and dgrad, each
#: row tile one expert's) and tokens (the wgrad, contracting each expert's tokens).
GROUPED_ROWS_NAME = "fp8jax_grouped_rows_gemm"
GROUPED_TOKENS_NAME = "fp8jax_grouped_tokens_gemm"

#: The one-pass quantization kernels' names (`block_quantize`, `padded_quantize`,
#: `cast_transpose`), in the HLO's op_name, where `fp8jax.hlo_cost` counts them as
#: quantization.
QUANTIZE_NAMES = (
    "fp8jax_quantize_rows",
    "fp8jax_quantize_rows_and_columns",
    "fp8jax_requantize_columns",
    "fp8jax_quantize_blocks",
    "fp8jax_quantize_padded_columns",
    "fp8jax_requantize_padded_columns",
    "fp8jax_cast_transpose",
    "fp8jax_quantize_rows_and_padded_columns",
    "fp8jax_tensor_core_cast_transpose",
    "fp8jax_tensor_core_quantize_rows_and_columns",
    "fp8jax_tensor_core_quantize_blocks",
    "fp8jax_tensor_core_requantize_columns",
    "fp8jax_tensor_core_quantize_rows",
    "fp8jax_tensor_core_quantize_padded_columns",
    "fp8jax_tensor_core_requantize_padded_columns",
    "fp8jax_tensor_core_quantize_rows_and_padded_columns",
)
#: The per-tensor cast-and-transpose kernel's name (`cast_transpose`).
CAST_TRANSPOSE_NAME = QUANTIZE_NAMES[6]
#: The same on TMA and the tensor cores (Mosaic GPU, `tensor_core_transpose`).
TENSOR_CORE_TRANSPOSE_NAME = QUANTIZE_NAMES[8]
#: Blockwise rows and columns on TMA and the tensor cores (`tensor_core_blocks`).
TENSOR_CORE_ROWS_AND_COLUMNS_NAME = QUANTIZE_NAMES[9]
#: A weight's 128 x 128 blocks and their transpose, the same way.
TENSOR_CORE_BLOCKS_NAME = QUANTIZE_NAMES[10]
#: A saved FP8 activation's 128 x 1 tiles, transposed, the same way.
TENSOR_CORE_REQUANTIZE_NAME = QUANTIZE_NAMES[11]
#: An activation's 1 x 128 tiles on TMA (nothing to transpose).
TENSOR_CORE_ROWS_NAME = QUANTIZE_NAMES[12]
#: An expert layer's gathered 128 x 1 tiles, the same way (`tensor_core_gathered`).
TENSOR_CORE_PADDED_NAME = QUANTIZE_NAMES[13]
#: A saved FP8 activation's gathered 128 x 1 tiles, the same way (`tensor_core_gathered`).
TENSOR_CORE_REQUANTIZE_PADDED_NAME = QUANTIZE_NAMES[14]
#: An expert layer's output gradient's rows copy and gathered copy from one read, the same way.
TENSOR_CORE_BOTH_PADDED_NAME = QUANTIZE_NAMES[15]
