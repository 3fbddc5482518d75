"""Weight sets from any source: resolving a weight source to one file (:mod:`.sources`, ``hf://`` in
:mod:`.hub`; both torch-free), reading the weight sets of any checkpoint file (:mod:`.read`), a strict load
(:mod:`.strict_load`), a warm start (:mod:`.warm_start`) and the key renaming rules (:mod:`.key_rules`).

May import: every ``checkpoint`` subpackage but ``export``, and the layers below ``checkpoint``.
"""
