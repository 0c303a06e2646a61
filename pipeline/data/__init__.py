"""Training data: the dataset and its fingerprint, the blocks on disk (token cache, chat tokens, packing), the
resumable sampler, and blocks to model inputs."""
