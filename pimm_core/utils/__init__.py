"""Small torch-free helpers usable as ``python -m`` tools."""
