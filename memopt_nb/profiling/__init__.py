"""What a model's training step costs, per unit: choosing the units, tracing one step's storages, timing it
(:func:`~memopt_nb.profiling.profile.profile`).
"""
