"""Training with FP8 state: the train step, gradients, accumulation, loss scaling,
precision policies, low-precision optimizer state and checkpoints."""
