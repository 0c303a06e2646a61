"""Ways of distributing the model over the ranks, behind one interface (base.Strategy): the four strategies, their
registry (registry.py), --strategy auto (auto.py), and the memory and traffic models they are weighed by.

Nothing is imported here, so the memory model can be read (MODEL_DOWNLOAD's table) without loading the wrappers.
"""
