"""Native GPU kernels (Pallas Mosaic GPU) for the GEMMs XLA cannot express as one FP8 call.

Pallas is imported by the kernel modules, on use; this package's top level stays light.
"""

#: The block-scaled GEMM kernel's name: in its PTX (`<name>_mosaic_gpu_kernel`) and in the
#: HLO's op_name, where `fp8jax.hlo_cost` recognizes it as a GEMM.
BLOCK_GEMM_NAME = "fp8jax_block_scaled_gemm"
