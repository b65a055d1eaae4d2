"""The cost model of one training step under a plan (``COST_MODEL.md``): the fast vectorised simulator and the
independent replay that checks it.
"""
