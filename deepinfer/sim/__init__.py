"""Cluster simulator and capacity planner (``deepinfer plan``).

``sim`` rather than ``simulator``/``planner``: the package holds both, and the planner is a search
over simulations. Nothing here touches a device: the engine's scheduler and KV cache manager run as
they do in the engine, and a cost model stands in for the forward pass.
"""
