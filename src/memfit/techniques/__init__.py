"""Memory techniques, one module each, applied in one documented order:

freeze -> checkpointing -> precision -> (distributed wrap) -> optimizer.

Freezing goes first so later steps see which parameters train; checkpointing changes how layers run and must
be in place before any wrapper; precision is a context and a scaler around the step; the optimizer is built
last, from the parameters that still require gradients, so frozen ones never get optimizer state.
"""
