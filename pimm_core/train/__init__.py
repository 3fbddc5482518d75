"""The trainer's parts: each owns one job and the state it needs (``state_dict``/
``load_state_dict`` where it has any); :class:`pimm_core.trainer.Trainer` builds them and
announces the moments of the loop. Plug-in points for users' own models build on these."""
