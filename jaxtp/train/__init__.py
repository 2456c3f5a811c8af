"""Training: the optimizer, the train state and its placement, the jitted steps,
the run's start-up and loop, its directory, checkpoints, data, metrics with the
one hardware table, the run record."""
