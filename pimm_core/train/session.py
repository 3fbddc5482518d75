"""What happens at the events of a ``Trainer.train()`` session: an optimizer step taken, an
evaluation, a non-finite stop, the session's end.

Functions of the trainer (like :mod:`~pimm_core.train.resume`), not parts it holds: they
read and update its parts (state, scheduler, best tracker, checkpointer, recorder, stop
agreement) in the order the loop needs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ..data.rng import set_epoch
from ..errors import CheckpointSaveError, ConfigError
from ..optim import observe_metric
from ..run.heartbeat import arm, beat_step
from ..targets import search_path
from .step import SKIPPED

if TYPE_CHECKING:
    from .host import TrainerHost

log = logging.getLogger("pimm")


def after_step(tr: TrainerHost, outcome: str, loss: torch.Tensor, samples: int, epoch: int,
               grad_norm: torch.Tensor | None = None) -> None:
    """An optimizer step was taken (or skipped): schedule, record (``grad_norm``: the window's
    gradient norm before clipping), callbacks, stop agreement."""
    s = tr.state
    if outcome == SKIPPED and tr.info.is_main:
        log.warning("warning: non-finite loss or gradient at step %d: step skipped "
                    "(train.on_nonfinite = 'skip')", s.global_step + 1)
    lr = tr.scheduler.get_last_lr()[0]
    tr.scheduler.step()
    s.global_step += 1
    beat_step(s.global_step)
    tr.recorder.on_step(epoch, loss, lr, samples, grad_norm=grad_norm)
    tr.callbacks.fire("on_step_end", tr)  # e.g. lambda tr: tr.stop.request("budget") if ... else None
    if not tr.info.distributed:  # (several ranks: checked at the window's end, window_flags)
        _check_time_limit(tr)
    reason = tr.stop_agreement.agree()
    if reason is not None:
        cause = tr.stop_agreement.cause
        s.stop_reason, s.save_error = reason, cause if isinstance(cause, CheckpointSaveError) else None
        tr.recorder.status("stopping")  # the console shows it until `last` is saved
        tr.callbacks.fire("on_stop_requested", tr, reason)


def window_flags(tr: TrainerHost) -> list[float] | None:
    """At an accumulation window's end (several ranks): the time limit is checked, and the stop
    agreement's flags ride in the window's all-reduce (:meth:`StopAgreement.window_flags`)."""
    if not tr.info.distributed:
        return None
    _check_time_limit(tr)
    return tr.stop_agreement.window_flags(tr.callbacks.has("on_step_end"))


def _check_time_limit(tr: TrainerHost) -> None:
    """Once per optimizer step (the limit's step time is the time between two checks)."""
    limit = tr.time_limit.reason(tr.checkpointer.last_save_s)  # train.max_time, $SLURM_JOB_END_TIME
    if limit is not None:
        tr.stop.request(limit)


def start_epoch(tr: TrainerHost) -> None:
    """Point the loader at the current epoch and position: the sampler's and the dataset's epoch
    (per-sample augmentation RNGs, :mod:`pimm_core.data.rng`), then a restored loader cursor, or,
    under ``data.order = "global"``, the samples consumed as the counters say (at any world size);
    an epoch's first batch records the step it began at."""
    s = tr.state
    if tr.sampler is not None:  # (None: a stream, which shards itself)
        tr.sampler.set_epoch(s.epoch)
    set_epoch(tr.data.train, s.epoch)
    if tr.config.data.order == "global":
        tr.sampler.set_start(s.iter)
        tr._pending_loader_state = None
    if tr._pending_loader_state is not None:
        tr.loader.load_state_dict(tr._pending_loader_state)
        tr._pending_loader_state = None
    if s.iter == 0:
        s.epoch_start_step = s.global_step


def stop_before_start(tr: TrainerHost) -> bool:
    """A stop asked before the first step (a signal during start-up, ``pimm stop``): every rank
    agrees; then True, ``tr.stopped_before_start`` is set and the session ends with the stop
    recorded, nothing trained or saved (the caller calls :func:`end_session`)."""
    reason = tr.stop_agreement.agree()
    if reason is None:
        return False
    tr.state.stop_reason = reason
    tr.stopped_before_start = True
    if tr.info.is_main:
        log.info("stop asked before the first step (%s): nothing trained, nothing saved", reason)
    return True


def evaluate_and_record(tr: TrainerHost, epoch: int) -> None:
    """Evaluate after ``epoch``; the selection metric steps a reduce-on-plateau schedule and
    may make a new best (``model_best``) or one of the ``checkpoint.keep_best`` kept; the metrics are recorded.

    Raises:
        ConfigError: ``eval.metric`` is not among the objective's metrics.
    """
    with tr.recorder.clock.paused():  # evaluation and the best files are not training time (samples/s)
        _evaluate_and_record(tr, epoch)


def _evaluate_and_record(tr: TrainerHost, epoch: int) -> None:
    s, e = tr.state, tr.config.eval
    metrics = tr.evaluate()
    s.last_eval, s.eval_step = metrics, s.global_step
    if e.metric not in metrics:
        raise ConfigError(f"eval.metric = {e.metric!r} is not reported by objective {tr.objective.name!r}; "
                          f"it reports {sorted(metrics)}")
    value = metrics[e.metric]
    observe_metric(tr.scheduler, value)  # reduce-on-plateau steps on the selection metric
    improved = tr.best.update(value, epoch)
    if improved:
        s.best_metric, s.best_epoch = tr.best.best, tr.best.epoch
        s.best_of = {"name": e.metric, "mode": e.mode}  # (a resume that changes either starts the best over)
    tr.checkpointer.on_evaluated(epoch, {"name": e.metric, "value": value, "mode": e.mode, "split": "val",
                                         "epoch": epoch, "weights": e.weights}, improved=improved)
    tr.recorder.on_eval(epoch, metrics, e.metric)
    tr.callbacks.fire("on_eval_end", tr, metrics)


def stop_nonfinite(tr: TrainerHost, epoch: int) -> None:
    """``train.on_nonfinite = "stop"``: nothing of this window is applied, so ``last`` keeps the
    weights from before it; the run fails (``state.error``)."""
    s = tr.state
    s.error = (f"non-finite loss or gradient at step {s.global_step + 1} (epoch {epoch}, "
               f"iter {s.iter}); the step was not applied")
    tr.stop.request(s.error)
    if tr.info.is_main:
        log.error("ERROR: %s (train.on_nonfinite = 'stop')", s.error)
    s.stop_reason = s.error
    tr.recorder.status("stopping")
    tr.callbacks.fire("on_stop_requested", tr, s.error)


def end_session(tr: TrainerHost) -> None:
    """Record how the session ended: ``status.json`` says ``finished``, ``stopped``, or ``failed``
    (a failed save, even the last ``model_best.pth`` write, is a failure, not the end of the run)."""
    s = tr.state
    if s.stop_reason is None and isinstance(tr.stop.cause, CheckpointSaveError):
        # a best/iter write failed after the last stop check
        s.stop_reason, s.save_error = tr.stop.reason, tr.stop.cause
    if s.stop_reason is not None:
        tr.stop_agreement.consume()  # consumed: must not stop the resumed run
        tr.recorder.on_stop()
    tr.recorder.status("failed" if s.save_error is not None else "finished" if s.finished else "stopped")
    tr.callbacks.fire("on_train_end", tr)


def start_files(tr: TrainerHost, entry: dict[str, Any], *, fresh: bool) -> None:
    """The run's files at a ``train()`` start: config, status and the provenance start ``entry``
    with what this start knows of the code and data (``code_search_path``: where ``pimm resume``,
    reading the config from the run directory, finds user code)."""
    if tr.threads is not None and tr.info.is_main:
        log.info("%s", tr.threads.describe())  # (said once per train() call)
    entry = {**entry, "data_resume": tr.data_resume, "user_code": tr._user_code,
             "code_search_path": search_path(tr.config_path)}
    if tr._model_library is not None:
        entry["model_library"] = tr._model_library  # how an export writes the model (its library)
    tr.recorder.start(tr.config, entry, fresh=fresh, code_version=tr._code_version,
                      data_fingerprint=tr.data.fingerprint)
    arm()  # ranks/<rank>.json from here: nothing in the run directory changed before this start
