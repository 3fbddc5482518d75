"""Two removers of one tree (a purge thread and a later rotation, or another process cleaning
up): each ends without an error, and the tree is gone (pimm_core.fsio.remove_tree)."""

from __future__ import annotations

import threading

from pimm_core.fsio import remove_tree


def test_a_tree_removed_by_two_removers_at_once_is_no_error(tmp_path):
    for round_ in range(5):
        tree = tmp_path / f"last.prev.{round_}"
        for d in range(20):
            (tree / f"d{d}").mkdir(parents=True)
            for f in range(50):
                (tree / f"d{d}" / f"f{f}").write_bytes(b"x")
        errors: list[BaseException] = []
        start = threading.Barrier(2)

        def remove() -> None:
            start.wait()
            try:
                remove_tree(tree)
            except BaseException as e:  # noqa: BLE001 - the test reports what either remover raised
                errors.append(e)

        threads = [threading.Thread(target=remove) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and not tree.exists(), (round_, errors)
