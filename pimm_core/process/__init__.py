"""The process a run runs in (layer **run**, torch-free at import): the process group and rank helpers
(:mod:`.dist`), one writer per run directory (:mod:`.lock`), stop requests from signals, threads and the
``control/stop`` file (:mod:`.stop`), the wall-clock budget (:mod:`.time_limit`), the console logger
(:mod:`.console_log`) and the commands pimm prints for the user to run (:mod:`.shell`).

May import: ``errors``, ``faults``, ``fsio``, ``text`` and ``run.*`` (the run directory's files);
never ``config``, ``data``, ``checkpoint``, ``train``. This ``__init__`` imports nothing.
"""
