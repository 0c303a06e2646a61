"""What a run trains for: the objectives the trainer calls, blind to which (pipeline/objectives/build.py)."""
