"""Small torch-free helpers usable as ``python -m`` tools (layer **cli**: may import any layer below it)."""
