"""Key rules: renaming a weight set's keys with ordered ``(regex, replacement)`` pairs (torch-free).

A checkpoint's keys often differ from the model's by a prefix: DDP's ``module.``,
``torch.compile``'s ``_orig_mod.``, a LightningModule's attribute (``model.``).
:data:`DEFAULT_KEY_RULES` strip the first two everywhere weights are read;
``train.key_rules`` replaces them for a warm start, and :func:`suggest_key_rule`
proposes one when nothing matched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from ...errors import CheckpointError, UsageError

#: Key rewrite rules applied when none are given: ordered ``(regex, replacement)`` pairs,
#: each applied with :func:`re.sub` to every key in turn.
DEFAULT_KEY_RULES: list[tuple[str, str]] = [
    (r"^module\.", ""),  # DistributedDataParallel / DataParallel
    (r"^_orig_mod\.", ""),  # torch.compile (also the module._orig_mod. of DDP(compile(m)))
    (r"^module\.", ""),  # compile(DDP(m)) leaves module. after _orig_mod.
    (r"\._orig_mod\.", "."),  # a compiled submodule
]


def apply_key_rules(sd: dict[str, Any], rules: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Rename the keys of ``sd`` with ordered ``(regex, replacement)`` rules.

    Each key goes through ``re.sub(regex, replacement, key)`` for every rule in order.
    Values are kept as they are (tied tensors stay tied).

    Args:
        rules: the rules; None means :data:`DEFAULT_KEY_RULES` (strip DDP ``module.`` and
            ``torch.compile`` ``_orig_mod.`` prefixes). An empty list renames nothing.

    Returns:
        A new dict in the original key order.

    Raises:
        UsageError: a rule is not a ``(regex, replacement)`` pair or its regex is invalid.
        CheckpointError: two keys are renamed to the same name (the message names them).
    """
    compiled = _compile_rules(DEFAULT_KEY_RULES if rules is None else rules)
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in sd.items():
        new = key
        for rx, repl in compiled:
            new = rx.sub(repl, new)
        if new in out:
            raise CheckpointError(f"key rules map both {origin[new]!r} and {key!r} to {new!r}; adjust the rules")
        out[new], origin[new] = value, key
    return out


def _compile_rules(rules: list[tuple[str, str]]) -> list[tuple[re.Pattern[str], str]]:
    compiled = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and all(isinstance(x, str) for x in rule)):
            raise UsageError(f"key rule {rule!r} is not a (regex, replacement) pair of strings")
        try:
            compiled.append((re.compile(rule[0]), rule[1]))
        except re.error as e:
            raise UsageError(f"key rule regex {rule[0]!r} is invalid: {e}") from None
    return compiled


def format_rules(rules: list[tuple[str, str]]) -> str:
    """Rules for a message, each as ``'regex' -> 'replacement'``, comma-separated; ``none`` for no rules."""
    return ", ".join(f"{p!r} -> {r!r}" for p, r in rules) or "none"


def suggest_key_rule(ckpt_keys: list[str], own: Iterable[str]) -> tuple[str, str] | None:
    """A ``(regex, replacement)`` rule that maps most checkpoint keys onto model keys, or None.

    Tries removing a leading prefix that the checkpoint keys share (``model.``, as
    Lightning writes them; ``encoder.backbone.``...) and adding one the model keys share.
    """
    model_keys = set(own)
    if not ckpt_keys or not model_keys:
        return None
    # a prefix the checkpoint has and the model lacks (strip it), or the other way round (add it)
    rules = [(n, ("^" + re.escape(p), "")) for p, n in _prefix_counts(ckpt_keys, model_keys).items()]
    rules += [(n, ("^", p)) for p, n in _prefix_counts(model_keys, set(ckpt_keys)).items()]
    return max(rules, key=lambda r: r[0])[1] if rules else None


def _prefix_counts(keys: Iterable[str], targets: set[str]) -> dict[str, int]:
    """How many of ``keys`` become a member of ``targets`` once each leading dotted prefix is removed."""
    counts: dict[str, int] = {}
    for k in keys:
        parts = k.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[i:]) in targets:
                prefix = ".".join(parts[:i]) + "."
                counts[prefix] = counts.get(prefix, 0) + 1
    return counts


def toml_literal(text: str) -> str:
    """``text`` as a TOML string: a literal string ('...') unless it holds a quote."""
    return f"'{text}'" if "'" not in text and "\n" not in text else json.dumps(text)
