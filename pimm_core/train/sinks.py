"""The metrics sinks beside ``metrics.jsonl`` (rank 0): TensorBoard, MLflow, Weights & Biases.

Each is used only when the config asks for it (``log.tensorboard``, ``[log.mlflow]``,
``[log.wandb]``) and its package is imported only then. :func:`check_available` runs before
any rank starts (and in ``--dry-run``): a missing package is one line. A sink gets every
record ``metrics.jsonl`` gets, and ``close(state)`` with how the session ended (the last
``status.json`` state; None: a resume that had nothing left to train wrote none); after a
resume each step is in every sink once (each sink's module says how).
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Any, Protocol

from ..config import Config, flatten
from ..errors import ConfigError, PimmError


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self, state: str | None) -> None: ...


def _wanted(config: Config) -> list[tuple[str, str]]:
    """``(config key, package)`` of each sink the config asks for."""
    log = config.log
    return [(key, package) for key, package, on in (("log.tensorboard = true", "tensorboard", log.tensorboard),
                                                    ("[log.mlflow]", "mlflow", log.mlflow is not None),
                                                    ("[log.wandb]", "wandb", log.wandb is not None)) if on]


def check_available(config: Config) -> None:
    """Raises:
        ConfigError: a configured sink's package is not installed (one line: how to install it).
    """
    for key, package in _wanted(config):
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key} needs the {package} package, which is not installed; install it with "
                              f"`uv sync` (the dev group) or `pip install {package}`, or remove {key}")


def run_params(config: Config, provenance: dict[str, Any]) -> dict[str, str]:
    """The run's config (dotted keys) and provenance (``provenance.<key>``) as text parameters."""
    params = {k: v for k, v in flatten(config.to_dict()).items()}
    params.update({f"provenance.{k}": v for k, v in provenance.items() if v is not None})
    return {k: str(v) for k, v in params.items()}


# what a sink's library reads besides its config keys (named in the error when it refuses to start)
_ENVIRONMENT = {"tensorboard": "the run directory's tensorboard/ entry",
                "mlflow": "the MLFLOW_* environment variables", "wandb": "the WANDB_* environment variables"}


def _reason(e: BaseException) -> str:
    """A library's refusal on one line: its class and first lines (a pydantic error names the
    setting on its second and the allowed values on its third)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()][:3]
    text = "; ".join(lines) or e.__class__.__name__
    return f"{e.__class__.__name__}: {text[:400]}"


def open_sinks(config: Config, run_dir: Path, *, resumed_at: int | None, eval_done: bool,
               provenance: dict[str, Any]) -> list[Sink]:
    """The sinks ``config`` asks for, opened for a fresh start (``resumed_at`` None) or a resume
    at global step ``resumed_at`` (``eval_done``: its evaluation is in the checkpoint).

    Raises:
        ConfigError: a package is missing (:func:`check_available`), or a sink's library refused
            to start (a bad ``WANDB_MODE``, an unsupported tracking URI, a ``WANDB_DIR`` that is a
            file, a server that does not answer): one line naming the sink and the library's
            reason; the sinks already opened are closed as failed.
    """
    check_available(config)
    sinks: list[Sink] = []
    for (key, package) in _wanted(config):
        try:
            sinks.append(_open(package, config, run_dir, resumed_at=resumed_at, eval_done=eval_done,
                               provenance=provenance))
        except Exception as e:  # noqa: BLE001 - any library's refusal is one line, not a traceback
            for sink in sinks:
                with contextlib.suppress(Exception):
                    sink.close("failed")
            if isinstance(e, PimmError):
                raise
            raise ConfigError(f"{key}: {package} could not start ({_reason(e)}); check {key} in the config and "
                              f"{_ENVIRONMENT[package]}, or remove {key}") from None
    return sinks


def _open(package: str, config: Config, run_dir: Path, *, resumed_at: int | None, eval_done: bool,
          provenance: dict[str, Any]) -> Sink:
    if package == "tensorboard":
        from .tensorboard import TensorBoardWriter

        return TensorBoardWriter(run_dir, resumed_at=resumed_at, eval_done=eval_done)
    if package == "mlflow":
        from .mlflow_sink import MlflowSink

        return MlflowSink(config, run_dir, resumed=resumed_at is not None, params=run_params(config, provenance))
    from .wandb_sink import WandbSink

    return WandbSink(config, run_dir, resumed_at=resumed_at, run_config={**config.to_dict(), "provenance": provenance})
