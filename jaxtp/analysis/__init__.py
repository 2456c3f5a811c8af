"""What a run communicates and needs, from compiled HLO: the analytic budget,
the --compare-hlo report, the planner, and compiling for accelerators one lacks."""
