"""Benchmarks that print ratios and counts: the suite (`suite`), collectives
(`collectives`), one accelerator (`gpu`), a plain-JAX peer (`peer`), the report."""
