"""Verifying a candidate's files against its manifest, with a per-process cache (torch-free).

:func:`verify_candidate` is the check resume applies before loading, and the one
``pimm checkpoints`` and the console run (through :mod:`.selection`, which re-exports it).
"""

from __future__ import annotations

from pathlib import Path

from .candidate import Candidate


def verify_candidate(c: Candidate) -> list[str]:
    """Problems found by checking a candidate's files against its manifest (sizes, sha256).

    Returns an empty list when every recorded file matches, or when the candidate has
    no manifest to check against (e.g. a legacy file written without a sidecar).
    """
    from ..records.manifest import outside_names, verify_files

    if c.manifest is None:
        return []
    p = Path(c.path)
    root = p if p.is_dir() else p.resolve().parent
    files = c.manifest.get("files", {})
    outside = outside_names(root, files)
    if outside:  # an invalid manifest: not even a stat of what it names outside
        return outside

    def key() -> tuple:
        return str(root), tuple((rel, _stat_key(root / rel), want.get("sha256"), want.get("size"))
                                for rel, want in files.items())

    before = key()
    if before in _VERIFIED:
        return list(_VERIFIED[before])
    problems = verify_files(root, files)
    if key() == before:  # a file replaced while it was hashed (a live rotation) is not cached
        if len(_VERIFIED) > 64:
            _VERIFIED.clear()
        _VERIFIED[before] = problems
    return list(problems)


_VERIFIED: dict[tuple, list[str]] = {}


def _stat_key(p: Path) -> tuple[int, int, int] | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
