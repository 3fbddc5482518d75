"""Callbacks: user objects told about the moments of a run, from the config or from Python.

A config names them as an array of tables, built in order on every rank before training::

    [[callbacks]]
    target = "mypkg.hooks:EventCounter"   # called as EventCounter(**args)
    [callbacks.args]
    every = 10

The object may define any of these methods (a missing one is skipped), each called on every
rank with the :class:`~pimm_core.trainer.Trainer` first, as Lightning calls its hooks:

- ``on_step_end(trainer)``: after each optimizer step, before the stop agreement (a
  ``trainer.stop.request(reason)`` here stops the run at this step);
- ``on_eval_end(trainer, metrics)``: after an evaluation, ``{"val/<name>": value}``;
- ``on_checkpoint_saved(trainer, path)``: a checkpoint was published at ``path`` (with
  ``checkpoint.async``: handed to the background writer);
- ``on_stop_requested(trainer, reason)``: the ranks agreed to stop early (``reason``: text);
- ``on_train_end(trainer)``: the ``train()`` call ends (finished or stopped, not on a failure).

``state_dict()`` / ``load_state_dict(state)``: rank 0's state is saved in every checkpoint
(plain values: numbers, strings, lists, dicts, tensors) and given back to the same callback
(same position and class) on resume. A plain function in ``trainer.callbacks`` (``fn(trainer)``)
is an ``on_step_end``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

from ..config import Config
from ..run.heartbeat import beat
from ..targets import TargetSpec, call, load

log = logging.getLogger("pimm")

#: The callback moments, in the order a run reaches them.
MOMENTS = ("on_step_end", "on_eval_end", "on_checkpoint_saved", "on_stop_requested", "on_train_end")


def specs(config: Config) -> list[TargetSpec]:
    """The ``[[callbacks]]`` targets of ``config`` (keys ``callbacks[i].target``)."""
    return [TargetSpec(f"callbacks[{i}].target", c.target, c.args or {}, f"callbacks[{i}].args")
            for i, c in enumerate(config.callbacks)]


def check(config: Config, config_path: str | Path | None = None) -> None:
    """Resolve every ``[[callbacks]]`` target and check its ``args`` (nothing is built).

    Raises:
        ConfigError: a target's module or attribute is missing, an argument is unknown or missing.
    """
    for spec in specs(config):
        load(spec, config_path)


class Callbacks(list):
    """The run's callbacks (a list: ``trainer.callbacks.append(obj_or_fn)`` adds one)."""

    @classmethod
    def from_config(cls, config: Config, config_path: str | Path | None = None) -> Callbacks:
        """Build the ``[[callbacks]]`` of ``config``, in order.

        Raises:
            ConfigError: as :func:`check`; whatever a factory raises, unchanged.
        """
        return cls(call(spec, config_path=config_path) for spec in specs(config))

    def fire(self, moment: str, trainer: Any, *args: Any) -> None:
        """Call ``moment`` (one of :data:`MOMENTS`) on every callback that defines it, with ``trainer``
        (the :class:`~pimm_core.trainer.Trainer`, passed on unread) and ``args``."""
        for cb in self:
            hook = getattr(cb, moment, None)
            if hook is not None or (moment == "on_step_end" and callable(cb)):
                beat("callback", f"{moment} of {getattr(cb, '__qualname__', None) or type(cb).__name__}")  # user code: where a rank may hang
            if hook is not None:
                hook(trainer, *args)
            elif moment == "on_step_end" and callable(cb) and not _has_any_moment(cb):
                cb(trainer)  # a plain function: lambda tr: tr.stop.request("budget") if ... else None

    def has(self, moment: str) -> bool:
        """Some callback would be called at ``moment`` (as :meth:`fire` calls them)."""
        return any(getattr(cb, moment, None) is not None
                   or (moment == "on_step_end" and callable(cb) and not _has_any_moment(cb)) for cb in self)

    def _keys(self) -> Iterable[tuple[str, Any]]:
        for i, cb in enumerate(self):
            yield f"{i}:{type(cb).__module__}.{type(cb).__qualname__}", cb

    def state_dict(self) -> dict[str, Any]:
        """``{"<index>:<module.Class>": state}`` of the callbacks that define ``state_dict()``."""
        return {key: cb.state_dict() for key, cb in self._keys() if callable(getattr(cb, "state_dict", None))}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Give each callback its saved state (a callback the checkpoint has none for is warned about)."""
        state = state or {}
        for key, cb in self._keys():
            if not callable(getattr(cb, "load_state_dict", None)):
                continue
            if key in state:
                cb.load_state_dict(state[key])
            else:
                log.warning("warning: the checkpoint holds no state for callback %s; it starts fresh", key)


def _has_any_moment(cb: Any) -> bool:
    return any(callable(getattr(cb, m, None)) for m in MOMENTS)
