"""provenance.user_code: a user module outside every installed distribution is versioned by its git
tree without reading every distribution's file list (importlib.metadata.packages_distributions:
~0.4 CPU-s and 1-2 s of rank 0 at every start of a run with user code); one where a distribution may
hold it still is."""

from __future__ import annotations

import sys

from pimm_core.run import provenance


def test_the_distributions_are_read_only_where_one_can_hold_the_module(tmp_path, monkeypatch):
    (tmp_path / "pimm_uc_probe").mkdir()
    (tmp_path / "pimm_uc_probe" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls: list[int] = []
    monkeypatch.setattr(provenance, "_packages_distributions", lambda: calls.append(1) or {})
    try:
        __import__("pimm_uc_probe")
        (code,) = provenance.user_code(["pimm_uc_probe"])
        assert calls == [] and code["git_commit"] is None and "distribution" not in code  # /tmp: no git tree
        (tmp_path / "pimm_uc_probe-1.0.dist-info").mkdir()  # now a distribution may live there
        (code,) = provenance.user_code(["pimm_uc_probe"])
        assert calls == [1] and "distribution" not in code  # asked; none of them names the package
    finally:
        sys.modules.pop("pimm_uc_probe", None)
