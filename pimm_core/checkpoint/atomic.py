"""Moved to :mod:`pimm_core.fsio` (the bottom layer); this name stays importable for old callers."""

from ..fsio import (  # noqa: F401
    TMP_SUFFIX,
    atomic_write_bytes,
    fsync_dir,
    fsync_file,
    fsync_tree,
    release_cached_pages,
    remove_stale_temporaries,
    remove_tree,
)
