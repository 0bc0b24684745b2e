"""Converting models: the framework-neutral config and layer choice, one adapter per
framework (Equinox and Haliax, Flax NNX) and the dispatcher `fp8_linear_layers`."""
