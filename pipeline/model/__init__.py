"""What we read of and do to a Hugging Face model: meta build, weights, model transforms, the loss and the
vocabulary-parallel head."""
