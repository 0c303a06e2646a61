"""Evaluation: held-out loss of a model on the blocks training packs (heldout), greedy samples of prompts while
training (samples), a PEFT adapter folder read back onto a built model (adapter_folder). The trainer and
`python -m pipeline.evaluate` (tools/evaluate) use them."""
