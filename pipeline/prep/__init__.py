"""Stages 1-3 and what they make: balanced split folders, the Arrow dataset, conversations in the formats users have,
the model in the offline hub cache and its check, and the bundled tiny model."""
