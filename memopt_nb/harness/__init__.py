"""Judging plans and showing them off: evaluation after Liu et al., the benchmark, the demo, the built-in models,
synthetic profiles, and plan-versus-no-plan measurements.
"""
