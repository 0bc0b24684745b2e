"""Layers built on the stateful ops: the FP8 Linear and the experts' grouped Linear."""
