"""The console's views, one per tab: Live, Checkpoints, Topology, Export.

Each view gets the newest :class:`~pimm_core.watch.snapshot.RunSnapshot` through ``show()``
(on the event loop) and redraws only what changed. Slow work (sha256, the resume
diff, export) runs in thread workers; nothing here reads files on the event loop.

The views never import the app (:mod:`pimm_tui.app`): they ask it for things with the
messages of :mod:`.common` (``OpenView``, ``RefreshRun``), which it handles.
"""
