"""Benchmarks that print ratios and counts: the suite (`suite`), collectives
(`collectives`), one accelerator (`gpu`), jaxtp against plain-JAX and PyTorch
peers (`versus`), the step's time by kind of work (`cpu_profile`), the step
predictor against published runs (`published`), the report."""
