"""Training: the optimizer, the train state and its placement, the jitted steps,
the loop, checkpoints, data, metrics with the one hardware table, the run record."""
