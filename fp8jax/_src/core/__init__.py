"""The ground floor: FP8 formats, amax, the state-overwrite convention, statistics, compiler
options, remat names and the compatibility layer over JAX and Mosaic GPU internals. Imports
nothing else of fp8jax."""
