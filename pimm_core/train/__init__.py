"""The trainer's parts: each owns one job and the state it needs (``state_dict``/
``load_state_dict`` where it has any); :class:`pimm_core.trainer.Trainer` builds them and
announces the moments of the loop. Plug-in points for users' own models build on these.

Also here: the LR schedules (:mod:`.schedule`), the EMA (:mod:`.ema`), the pre-launch checks of a
config's user code (:mod:`.plugins`), and :mod:`.host`, the trainer as its session and resume functions
see it (a ``Protocol``, so they do not import :mod:`pimm_core.trainer` back).

May import: ``checkpoint``, ``data``, ``models``, ``objectives``, ``optim``, ``config``, ``process``,
``run`` and the bottom layer; never ``watch``, ``launch``, ``cli`` or ``pimm_tui``. Only
:mod:`pimm_core.trainer` imports the parts together; no part imports the trainer.
"""
