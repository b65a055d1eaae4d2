"""The data every layer shares and nothing below it: errors, budgets, the plan and its vocabulary, the plan space,
the device spec and presets, the profile's data types, the progress long calls report.
"""
