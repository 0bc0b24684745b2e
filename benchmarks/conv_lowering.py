"""What XLA compiles an FP8 convolution to on an H100 (deviceless: no GPU needed, no timing).

    python benchmarks/conv_lowering.py > benchmarks/results/conv_lowering.txt

A 3x3 convolution (NHWC activations, HWIO kernel, float32 output) of E4M3 operands and of
BF16 operands: the custom call that runs it and the types of its operands, read from the
compiled HLO. The question behind it: could fp8jax convert convolutions to FP8 (issue 29)?
"""

import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fp8jax._src.observe import deviceless  # noqa: E402


def conv(x, w):
    return jax.lax.conv_general_dilated(
        x,
        w,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        preferred_element_type=jnp.float32,
    )


def main() -> None:
    topology = deviceless.h100_topology(1)
    if topology is None:
        raise SystemExit("needs jax's CUDA plugin (pip install 'fp8jax[h100]')")
    x = jax.ShapeDtypeStruct((32, 56, 56, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 256, 256), jnp.float32)
    print(f"jax {jax.__version__}, {topology.devices[0].device_kind} (deviceless)")
    print(f"conv {x.shape} (NHWC) x {w.shape} (HWIO), SAME, float32 output")
    for name, dtype in (("e4m3", jnp.float8_e4m3fn), ("bf16", jnp.bfloat16)):
        fn = lambda x, w, dtype=dtype: conv(x.astype(dtype), w.astype(dtype))  # noqa: E731
        lowered, _ = deviceless.lower(fn, (x, w), {}, topology.devices[0])
        text = lowered.compile().as_text()
        for line in text.splitlines():
            call = re.search(r'custom_call_target="([^"]*conv[^"]*)"', line)
            if not call or "custom-call(" not in line:
                continue
            operands = re.search(r"custom-call\(([^)]*)\)", line).group(1).split(", ")
            types = []
            for operand in operands:
                for other in text.splitlines():
                    if other.strip().startswith(operand + " ="):
                        types.append(other.split("=", 1)[1].split("[", 1)[0].strip())
            print(f"{name} operands: {call.group(1)} with operands of types {types}")


if __name__ == "__main__":
    main()
