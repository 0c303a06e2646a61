"""Commands around training: chat with a model, experiments and their analysis."""
