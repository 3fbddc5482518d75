"""A character-level Transformer language model on Python's own standard-library source."""
