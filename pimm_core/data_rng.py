"""Compatibility name of :mod:`pimm_core.data.rng`: user code written as ``from pimm_core.data_rng import
EpochSeeded`` (the spelling the docs showed before the regroup) keeps working."""

from .data.rng import EpochSeeded, sample_generator, sample_numpy, sample_random, sample_seed, set_epoch

__all__ = ["EpochSeeded", "sample_generator", "sample_numpy", "sample_random", "sample_seed", "set_epoch"]
