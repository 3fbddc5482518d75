"""Example user code for pimm, named from configs/ by ``model.target``/``data.target``
(importable from the repository root, where pimm is run)."""
