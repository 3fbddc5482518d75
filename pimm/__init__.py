"""``pimm``: the name the reference documentation uses for pimm's modules.

A thin alias: the code lives in :mod:`pimm_core` (engine, torch-free scripting) and
:mod:`pimm_tui` (the console). ``python -m pimm.utils.path latest-checkpoint MODEL_DIR``
runs :mod:`pimm_core.utils.path`.
"""
