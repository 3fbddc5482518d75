"""A small user package the end-to-end tests train through config targets and the Python API.

``nets.tied_bn``: a model with BatchNorm and an output head tied to a class embedding;
``data.digits_aug``: a map-style slice of the bundled digits with random per-sample
augmentation from :mod:`pimm_core.data.rng`; ``objective.smoothed_ce``: a user objective.
"""
