"""The config schema: one dataclass per TOML table, with its defaults (torch-free).
Reading and validating a file is :mod:`.load`.

A config is a TOML file read with :mod:`tomllib`. Its tables map onto the
dataclasses below; unknown keys, wrong types and out-of-range values raise
:class:`~pimm_core.errors.ConfigError` with one line naming the key (and the
file line where it can be found) plus a suggestion for near-miss keys.

Overrides are ``dotted.key=value`` strings whose value uses TOML value syntax
(``train.lr=3e-4``, ``run.group="ablation"``); a value that is not valid TOML
is taken as a bare string, so ``checkpoint_format=standard`` works too.

Bringing your own code (see :mod:`pimm_core.targets` for where it is imported from):

- ``model.target = "pkg.mod:factory"`` with ``[model.args]``: the model, built as
  ``factory(**args)``; replaces ``model.name``/``hidden``/``dropout``. The built-in
  models are targets too: ``model.target = "pimm_core.models:mlp"`` is ``model.name = "mlp"``.
- ``data.target`` with ``[data.args]``: returns the train and validation datasets
  (map-style or iterable) and optionally a collate function (see
  :func:`pimm_core.data.as_datasets`); replaces ``data.name``/``val_fraction``/
  ``split_seed``, which are the args of ``"pimm_core.data:digits"``.
- ``objective``: what a step computes, a built-in name (:data:`OBJECTIVES`) or a target
  ``(model, batch) -> (loss, {metric: value})`` (see :mod:`pimm_core.objectives`).
- ``[optimizer]``: ``name`` (any ``torch.optim`` class, case-insensitive) or ``target``,
  with ``args``; overrides ``train.optimizer``. ``[scheduler]``: ``name`` (a kind of
  :data:`SCHEDULER_KINDS`, after ``train.warmup_steps`` of linear warmup) or ``target``,
  with ``args``; overrides ``train.scheduler``. See :mod:`pimm_core.optim`.
- ``log.tensorboard``: also write the metrics for TensorBoard; ``[log.mlflow]``, ``[log.wandb]``:
  also send them to MLflow, to Weights & Biases.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from .tables import toml_key


@dataclass
class RunConfig:
    """Where the run directory goes: ``<root>/<group>/<name>[-YYYYmmdd-HHMMSS]``."""

    root: str = "exp"
    group: str = "default"
    name: str = ""  # empty: the config file's stem
    no_timestamp: bool = False


@dataclass
class TrainConfig:
    """Optimisation settings. Steps are optimizer steps (one per accumulation window)."""

    epochs: int = 10
    seed: int = 0
    lr: float = 1e-3
    grad_accum: int = 1
    # samples per optimizer step under data.order = "global" (then grad_accum is derived:
    # global_batch / (data.batch_size * ranks)); unused by the default order
    global_batch: int | None = None
    max_steps: int | None = None  # optional cap on global steps: an endpoint, not a pause
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = 0.01
    momentum: float = 0.9  # SGD only
    scheduler: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr: float = 0.0
    grad_clip: float | None = 1.0  # max global L2 norm; None disables clipping
    on_nonfinite: Literal["stop", "skip", "continue"] = "stop"  # a NaN/Inf gradient norm: stop before applying it,
    # skip that step, or apply it anyway
    amp: Literal["none", "bf16", "fp16"] = "none"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every_steps: int = 10
    resume: bool = False
    weight: str = ""  # warm-start weights (not a resume): a path, a run keyword source or hf://org/repo[/file]
    weight_set: Literal["raw", "ema"] = "raw"  # which weights of `weight` to load
    key_rules: list[list[str]] | None = None  # ordered [regex, replacement]; None: strip module. and _orig_mod.
    strategy: Literal["ddp", "fsdp"] = "ddp"  # how ranks share the model: replicas (DDP) or shards (FSDP2); see [fsdp]
    compile: bool = False  # torch.compile the model in place (state dict keys unchanged: no _orig_mod.)
    blocks: list[str] | None = None  # the model's repeated blocks: class names, or targets
    # "pkg.mod:fn" with fn(model) -> iterable of submodules; FSDP shards each block as a unit and
    # activation checkpointing recomputes each block's activations
    activation_checkpointing: bool = False  # recompute each of train.blocks' activations in backward
    find_unused_parameters: bool = False  # DDP: allow parameters that get no gradient in a step (a layer frozen
    # mid-run, a branch not taken); costs a pass over the autograd graph each step
    # signals that stop the run cleanly (save `last`, exit 0), on every rank; left as it is, inside a Slurm
    # job ($SLURM_JOB_ID set) SIGUSR1 too (`sbatch --signal=B:USR1@60`); add the one another scheduler sends
    stop_signals: list[str] = field(default_factory=lambda: ["SIGINT", "SIGTERM", "SIGHUP"])
    # wall-clock budget of one session: seconds, or "HH:MM:SS" / "D-HH:MM:SS" like Slurm's --time; the
    # run stops cleanly with `last` saved before it (and before $SLURM_JOB_END_TIME); see docs/clusters-guide.md
    max_time: float | str | None = None
    # inside a Slurm job: after a clean stop by a signal or the time limit, `scontrol requeue` the job
    # (it starts again under the same id; with --train.auto-resume it continues exactly). Unset: inside a
    # Slurm job whose command resumes (--train.auto-resume, pimm resume), after SIGUSR1 or the time limit
    requeue: bool | None = None
    # intra-op CPU threads per rank (torch.set_num_threads); None: OMP_NUM_THREADS if you set it, else
    # chosen from the usable CPUs (affinity, cgroup quota) shared among the node's ranks (pimm_core.process.threads)
    threads: int | None = None


@dataclass
class DataConfig:
    """Dataset and loader. ``batch_size`` is per rank and per micro-batch.

    ``target``/``args`` name a user dataset factory; then ``name``, ``val_fraction``
    and ``split_seed`` (the built-in digits' settings) are not used.
    """

    name: str = "digits"
    batch_size: int = 32
    num_workers: int = 0  # per rank
    shuffle: bool = True  # a new permutation of the train split each epoch (seed + epoch); false: in order
    # drop the samples that do not fill the epoch evenly: none repeated to pad the ranks' shards, no short last batch
    drop_last: bool = False
    # "rank": each rank's shard of a DistributedSampler (the default); "global": one order and
    # batching whatever the number of ranks, so a resume on another world size continues the same
    # run (needs train.global_batch; docs/elastic.md)
    order: Literal["rank", "global"] = "rank"
    # how DataLoader workers start (PyTorch's argument): "forkserver" from a clean process; "spawn";
    # "fork" copies the rank with its threads and can hang (pimm_core.data.workers)
    multiprocessing_context: Literal["forkserver", "spawn", "fork"] = "forkserver"
    timeout: float = 600.0  # seconds a rank waits for a batch from its workers before failing (0: forever)
    val_fraction: float = 0.2
    split_seed: int = 0
    target: str | None = None  # "package.module:factory" returning the train and val datasets
    args: dict[str, Any] | None = None  # keyword arguments of target


@dataclass
class ModelConfig:
    """The model: a built-in ``name`` with ``hidden``/``dropout``, or a ``target`` factory
    called with ``args`` (then ``name``, ``hidden`` and ``dropout`` are not used)."""

    name: str = "mlp"
    hidden: int = 128
    dropout: float = 0.1
    target: str | None = None  # "package.module:factory" returning an nn.Module
    args: dict[str, Any] | None = None  # keyword arguments of target


@dataclass
class OptimizerConfig:
    """``[optimizer]``: overrides ``train.optimizer`` when ``name`` or ``target`` is set.

    The LR is always ``train.lr`` and the weight decay ``train.weight_decay``; ``args``
    holds the optimizer's other keyword arguments (``betas``, ``eps``, ``momentum``...).
    ``decay_bias_and_norm`` unset or false: biases and normalization weights get no weight
    decay (a second parameter group); true: one group, everything decays. (The older
    ``train.optimizer`` key keeps its single group.)
    """

    name: str | None = None  # a torch.optim class, e.g. "AdamW", "SGD", "RMSprop" (case-insensitive)
    target: str | None = None  # "package.module:factory" called as factory(param_groups, lr=..., **args)
    args: dict[str, Any] | None = None
    decay_bias_and_norm: bool | None = None


SchedulerKind = Literal["constant", "linear", "cosine", "step", "multistep", "exponential", "onecycle", "plateau"]
#: The ``scheduler.name`` values (each after ``train.warmup_steps`` of linear warmup).
SCHEDULER_KINDS: tuple[str, ...] = typing.get_args(SchedulerKind)


@dataclass
class SchedulerConfig:
    """``[scheduler]``: overrides ``train.scheduler`` when ``name`` or ``target`` is set.

    ``args`` are the kind's options (``step_size``, ``milestones``, ``gamma``, ``pct_start``,
    ``patience``...; see :mod:`pimm_core.optim`) or the target's keyword arguments.
    """

    name: SchedulerKind | None = None
    target: str | None = None  # "package.module:factory" called as factory(optimizer, **args)
    args: dict[str, Any] | None = None


@dataclass
class MlflowConfig:
    """``[log.mlflow]``: also send the metrics to an MLflow tracking server (pimm_core.train.mlflow_sink)."""

    tracking_uri: str = ""  # "": MLFLOW_TRACKING_URI, else MLflow's own default (mlflow.db or ./mlruns in the working directory, by MLflow version)
    experiment: str = ""  # "": the run's group


@dataclass
class WandbConfig:
    """``[log.wandb]``: also send the metrics to a Weights & Biases run (pimm_core.train.wandb_sink)."""

    project: str = ""  # "": the run's group
    entity: str = ""  # "": WANDB_ENTITY, else your W&B default entity
    mode: Literal["", "online", "offline", "disabled"] = ""  # "": WANDB_MODE, else W&B's default (online)


@dataclass
class LogConfig:
    tensorboard: bool = False  # also write metrics as TensorBoard events (metrics.jsonl stays the source)
    mlflow: MlflowConfig | None = None  # [log.mlflow] present: also an MLflow sink
    wandb: WandbConfig | None = None  # [log.wandb] present: also a W&B sink (files under WANDB_DIR, else the run dir)


@dataclass
class CallbackConfig:
    """One ``[[callbacks]]`` entry: ``target`` is a factory called with ``args`` (:mod:`pimm_core.train.callbacks`)."""

    target: str = ""  # "package.module:Factory"
    args: dict[str, Any] | None = None  # keyword arguments of target


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: no step-based saves
    every_epochs: int = 1  # 0: no epoch-end saves (the end of training still saves)
    keep_iter: int = 3  # how many iter_<step>.pth snapshots to keep; 0 keeps none
    keep_best: int = 1  # 1: model_best.pth only; k >= 2: also the k best evaluations as best_<step>.pth
    keep_last: int = 3  # single format: how many step_<step>.pth files to keep (pointer targets always kept)
    keep_full: int = 1  # standard format: how many full checkpoints to keep: last and the newest k-1 superseded
    # ones as full_<step>/ (each can resume: --train.resume-from model/full_<step>)
    on_error: Literal["stop", "continue"] = "stop"  # a failed periodic save stops the run (or only warns)
    async_: bool = False  # TOML key `async`: write periodic standard saves in the background
    gather_weights: bool = True  # FSDP: also gather the full weights into weights.pth (rank 0, via CPU);
    # false: the weights stay sharded in trainer.dcp/ (export, warm start and resume read them there)
    remote: str = ""  # e.g. "s3://bucket/prefix": every published checkpoint is also uploaded there (fsspec)
    remote_options: dict[str, Any] | None = None  # storage options of the remote's filesystem (e.g. endpoint_url)
    remote_timeout: float = 600.0  # seconds the run's end waits for uploads still in flight
    memory_every_steps: int = 0  # 0: off; N: every N-th optimizer step each rank keeps its trainer state in
    # node-local shared memory and on a buddy rank (the memory tier a `--max-restarts` restart recovers from)


@dataclass
class FsdpConfig:
    """``[fsdp]``: options of ``train.strategy = "fsdp"`` (``torch.distributed.fsdp.fully_shard``).

    ``param_dtype``/``reduce_dtype`` form FSDP2's ``MixedPrecisionPolicy`` (unset: the
    parameters' own dtype); ``cpu_offload`` keeps the sharded parameters, gradients and
    optimizer state in CPU memory (``CPUOffloadPolicy``) between uses.
    """

    reshard_after_forward: bool = True  # free each block's gathered parameters after its forward (ZeRO-3); false: keep them until backward (ZeRO-2-like, more memory, less communication)
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = None  # compute dtype of the gathered parameters
    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = None  # dtype of the gradient reduce-scatter
    cpu_offload: bool = False


@dataclass
class ParallelConfig:
    """``[parallel]``: how each layer is split across ranks (tensor parallel, as torchtitan).

    The ranks form a 2-D ``DeviceMesh`` ``("dp", "tp")``: ``tp`` ranks share each layer
    (``parallelize_module`` with ``tp_plan``'s styles), and the data-parallel degree is the world
    size / ``tp`` (each data-parallel rank reads its own batches; ``train.strategy = "fsdp"``
    shards over ``dp``). See docs/scaling.md.
    """

    tp: int = 1  # tensor-parallel degree: ranks that share each layer; it must divide the world size
    tp_plan: str | None = None  # "package.module:fn" with fn(model) -> {module FQN: ParallelStyle}; unset: the
    # built-in plan of the model's class (the bundled char LM, Hugging Face GPT-2 and Llama)


@dataclass
class DistConfig:
    """``[dist]``: the process group of a multi-rank run (``torch.distributed``)."""

    timeout: float = 30.0  # minutes a rank waits in a collective (all-reduce, barrier, save) for its peers before
    # the run fails, naming the rank it waited for and that rank's phase (ranks/<rank>.json); see docs/hangs.md


@dataclass
class EvalConfig:
    every_epochs: int = 1
    batch_size: int | None = None  # per rank; unset: max(data.batch_size, 256)
    metric: str = "val/acc"
    mode: Literal["max", "min"] = "max"
    weights: Literal["raw", "ema"] = "raw"  # evaluate the raw or the EMA weights


@dataclass
class EmaConfig:
    """EMA of the parameters, updated after each optimizer step (see pimm_core.train.ema)."""

    enabled: bool = False
    decay: float = 0.999
    warmup: bool = True  # decay ramps up as min(decay, (1 + n) / (10 + n)) over n updates


@dataclass
class Config:
    """The whole run configuration (one TOML file)."""

    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    callbacks: list[CallbackConfig] = field(default_factory=list)  # [[callbacks]] tables, called in order
    objective: str = "classification"  # a name in OBJECTIVES or a "package.module:function" target
    checkpoint_format: Literal["standard", "legacy", "single"] = "standard"
    resume_strict_state: bool = True

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict with TOML key names, ``None`` values and tables left empty by
        that dropped (TOML has no null; an unused ``[optimizer]`` is not written)."""
        d = _drop_none(dataclasses.asdict(self))
        if not d["callbacks"]:
            del d["callbacks"]  # (no [[callbacks]]: nothing written, as before they existed)
        return d


def _drop_none(d: Any, rename: bool = True) -> Any:
    if isinstance(d, list):  # an array of tables ([[callbacks]])
        return [_drop_none(x, rename) for x in d]
    if not isinstance(d, dict):
        return d
    out = {}
    for k, v in d.items():
        # an args table holds the user's own keyword names: never renamed
        v = _drop_none(v, rename and k != "args")
        if v is None or (rename and isinstance(v, dict) and not v and k != "args"):
            continue
        out[toml_key(k) if rename else k] = v
    return out
