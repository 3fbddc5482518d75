"""Tied tensors: several names in a model for one parameter or buffer (``head.weight is embed.weight``).

A model ties names by making them refer to one tensor object; a state dict has an entry
per name, tied names sharing one tensor. These helpers keep the views consistent:
:func:`find_aliases` finds the ties of a state dict (by storage: what a file stores
once), :func:`tied_groups` those of a model (by identity, never by name),
:func:`follow_model_ties` makes a weight set agree with the model's before a load, and
:func:`tie_parameters` restores a tie that a model built untied should have (an
export's recorded aliases).

In a model, the *canonical* name of a group is the first in registration order, the name
``named_parameters()`` (which drops duplicates) reports. In a file, the name kept is the
first in sorted order, so that it does not depend on the order of the state dict.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn

def find_aliases(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """Names in ``sd`` that are the same tensor view as another name.

    Two entries are aliases when they share storage, offset, shape, stride and dtype.
    The first name in sorted order is the one kept.

    Returns:
        ``{alias: kept}``, sorted by alias.
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    for k in sorted(sd):
        t = sd[k]
        if t.device.type == "meta" or t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        groups.setdefault(key, []).append(k)
    return dict(sorted((alias, names[0]) for names in groups.values() for alias in names[1:]))


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The model's tied names: each group is one tensor object's names, canonical first.

    Parameters and buffers (persistent or not) are both looked at; a name that is the only
    one for its tensor is in no group.
    """
    by_tensor: dict[int, list[str]] = {}
    for name, t in chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        by_tensor.setdefault(id(t), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def follow_model_ties(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``sd`` in which every name of a tied group holds one tensor: the group's first present.

    ``load_state_dict`` copies each entry into the one shared tensor in turn, so with
    differing values for two tied names the last copied would win. Here the canonical name's
    value wins (else that of the first of the group's names that ``sd`` has), and a tied name
    that ``sd`` lacks (a file that stores each tensor once, as Hugging Face checkpoints do) is
    filled from its group: the model holds one value for them all either way.

    Returns:
        A new dict; ``sd`` is not changed. Names outside the model's ties are kept as they are.
    """
    own = model.state_dict().keys()  # a non-persistent buffer's name is never filled in
    out = dict(sd)
    for group in tied_groups(model):
        names = [n for n in group if n in own]
        present = [n for n in names if n in sd]
        for n in names if present else ():
            out[n] = sd[present[0]]
    return out


def tie_parameters(model: nn.Module, aliases: dict[str, str]) -> None:
    """Make each ``alias`` name of ``model`` refer to its ``kept`` name's parameter or buffer.

    For a model built with separate tensors under names that were tied when exported
    (``aliases`` is ``{alias: kept}``). A name already tied, or missing from the model,
    is left as it is.
    """
    for alias, kept in sorted(aliases.items()):
        a_mod, _, a_name = alias.rpartition(".")
        k_mod, _, k_name = kept.rpartition(".")
        try:
            am, km = model.get_submodule(a_mod), model.get_submodule(k_mod)
        except AttributeError:
            continue
        for table in ("_parameters", "_buffers"):
            at, kt = getattr(am, table), getattr(km, table)
            if a_name in at and k_name in kt and at[a_name] is not kt[k_name] and kt[k_name] is not None:
                at[a_name] = kt[k_name]
                break
