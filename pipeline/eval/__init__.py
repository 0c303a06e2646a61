"""Evaluation: held-out loss of a model on the blocks training packs (heldout), greedy samples of prompts while
training (samples), and `python -m pipeline.evaluate` on any model or adapter (cli)."""
