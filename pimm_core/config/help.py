"""One line of meaning per config key, beside the schema (:mod:`pimm_core.config`), torch-free.

The schema's dataclasses give each key its type and default; this table gives its meaning. The
documentation's reference (``docs/hooks/reference.py``) is generated from both, and
``tests/unit/test_docs.py`` fails when a key of the schema has no line here (or a line here names
no key): adding a key to the schema means adding its line here.

Keys are dotted as in overrides; the keys of an optional table (``[log.mlflow]``) and of an array
of tables (``[[callbacks]]``) are spelled ``log.mlflow.tracking_uri`` and ``callbacks.target``.
"""

from __future__ import annotations

KEY_HELP: dict[str, str] = {
    # [run]
    "run.root": "directory that holds the run directories (`<root>/<group>/<name>`); a local path",
    "run.group": "the run's group: one directory level under `run.root`",
    "run.name": "the run's name (empty: the config file's stem); `-YYYYmmdd-HHMMSS` is appended unless `run.no_timestamp`",
    "run.no_timestamp": "use `run.name` as given (needed by multi-node and external launchers, and to resume by name)",
    # [train]
    "train.epochs": "epochs to train (the run's length; `train.max_steps` may end it earlier)",
    "train.seed": "seeds model init (same on every rank), each rank's RNG (`seed + rank`) and the data order",
    "train.lr": "base learning rate (peak after warmup)",
    "train.grad_accum": "micro-batches per optimizer step (the accumulation window); derived under `data.order = \"global\"`",
    "train.global_batch": "samples per optimizer step under `data.order = \"global\"`, whatever the number of ranks",
    "train.max_steps": "optional cap on optimizer steps: an endpoint, not a pause",
    "train.optimizer": "built-in optimizer when `[optimizer]` names none",
    "train.weight_decay": "weight decay (decoupled for AdamW)",
    "train.momentum": "SGD momentum (`train.optimizer = \"sgd\"` only)",
    "train.scheduler": "LR schedule after warmup when `[scheduler]` names none: cosine to `train.min_lr`, or constant",
    "train.warmup_steps": "optimizer steps of linear warmup to `train.lr`",
    "train.min_lr": "the LR the cosine (or linear) schedule ends at",
    "train.grad_clip": "max global L2 norm of the gradients; unset disables clipping",
    "train.on_nonfinite": "a NaN/Inf gradient (or gradient norm): stop before applying the step, skip the step, or apply it anyway",
    "train.amp": "autocast dtype: none, bf16 or fp16 (fp16 adds a GradScaler; CUDA only)",
    "train.device": "where to train: auto (CUDA when available), cpu or cuda",
    "train.log_every_steps": "optimizer steps between train records in `train.log` and `metrics.jsonl`",
    "train.resume": "resume the run from its newest intact checkpoint (`--train.resume`)",
    "train.weight": "warm start: load weights (only) from a path or `hf://org/repo[/file]`",
    "train.weight_set": "which weights of `train.weight` to load: raw or EMA",
    "train.key_rules": "ordered `[regex, replacement]` rules applied to warm-start keys; unset strips `module.` and `_orig_mod.`",
    "train.strategy": "how ranks share the model: ddp (replicas) or fsdp (FSDP2 shards; see `[fsdp]`)",
    "train.compile": "`torch.compile` the model in place (state dict keys unchanged)",
    "train.blocks": "the model's repeated blocks (class names or a `pkg.mod:fn` target): FSDP units and activation-checkpointing units",
    "train.activation_checkpointing": "recompute each of `train.blocks`' activations in backward",
    "train.find_unused_parameters": "DDP: allow parameters without a gradient in a step (a layer frozen mid-run)",
    "train.stop_signals": "signals that stop the run cleanly (save `last`, exit 0); inside a Slurm job SIGUSR1 too",
    "train.max_time": "wall-clock budget of one session (seconds or `HH:MM:SS`/`D-HH:MM:SS`): stop cleanly before it",
    "train.requeue": "inside a Slurm job: `scontrol requeue` the job after a clean stop by a signal or the time limit "
                     "(unset: after SIGUSR1 or the time limit, when the job's command resumes)",
    "train.threads": "intra-op CPU threads per rank; unset: `OMP_NUM_THREADS` if you set it, else chosen from the usable CPUs shared among the node's ranks (1 for a model under 1M parameters)",
    # [data]
    "data.name": "built-in dataset (`digits`) when `data.target` is unset",
    "data.batch_size": "per-rank micro-batch size",
    "data.num_workers": "DataLoader worker processes per rank (0: load in the rank)",
    "data.order": "`rank` (each rank's shard) or `global`: one order and batching for any world size, so a world-size change resumes without replay",
    "data.shuffle": "a new permutation of the train split each epoch (`seed + epoch`); false: in order",
    "data.drop_last": "drop the samples that do not divide evenly among ranks and the short last batch",
    "data.multiprocessing_context": "how DataLoader workers start: forkserver (from a clean process), spawn or fork",
    "data.timeout": "seconds a rank waits for a batch from its workers before failing (0: forever)",
    "data.val_fraction": "built-in digits: share of the samples held out for validation",
    "data.split_seed": "built-in digits: seed of the train/validation split",
    "data.target": "`package.module:factory` returning the train and validation datasets",
    "data.args": "keyword arguments of `data.target`",
    # [model]
    "model.name": "built-in model (`mlp` or `cnn`) when `model.target` is unset",
    "model.hidden": "built-in models: hidden width",
    "model.dropout": "built-in models: dropout probability",
    "model.target": "`package.module:factory` returning an `nn.Module`",
    "model.args": "keyword arguments of `model.target`",
    # [checkpoint]
    "checkpoint.every_steps": "also save `last` and an `iter_<step>.pth` snapshot every N optimizer steps (0: never)",
    "checkpoint.every_epochs": "save `last` at every N-th epoch end (0: only at the end of training)",
    "checkpoint.memory_every_steps": "every N optimizer steps keep each rank's trainer state in shared memory and on a buddy rank, for a `--max-restarts` restart (0: off)",
    "checkpoint.keep_iter": "how many `iter_<step>.pth` snapshots to keep (0 keeps none)",
    "checkpoint.keep_last": "single format: how many `step_<step>.pth` files to keep (pointer targets always kept)",
    "checkpoint.keep_full": "standard format: full checkpoints kept: `last` and the newest k-1 superseded ones as `full_<step>/`",
    "checkpoint.keep_best": "how many of the best evaluations to keep as `best_<step>.pth` (1: only `model_best.pth`)",
    "checkpoint.on_error": "a failed periodic save stops the run (exit 1) or only logs the error",
    "checkpoint.async": "write periodic standard saves in the background (the step is blocked only for the copy)",
    "checkpoint.gather_weights": "FSDP: also gather the full weights into `weights.pth` on rank 0 (false: they stay sharded)",
    "checkpoint.remote": "fsspec URL (`s3://bucket/prefix`) every published checkpoint is also uploaded to",
    "checkpoint.remote_options": "storage options of the remote's filesystem (e.g. `endpoint_url`)",
    "checkpoint.remote_timeout": "seconds the run's end waits for uploads still in flight",
    # [eval]
    "eval.every_epochs": "evaluate at every N-th epoch end and at the end of training (0: never)",
    "eval.batch_size": "per-rank evaluation batch size; unset: `max(data.batch_size, 256)`",
    "eval.metric": "the selection metric (`val/<name>`) that decides `model_best.pth`",
    "eval.mode": "whether a larger (max) or smaller (min) selection metric is better",
    "eval.weights": "evaluate the raw or the EMA weights",
    # [ema]
    "ema.enabled": "keep an exponential moving average of the parameters",
    "ema.decay": "EMA decay per optimizer step",
    "ema.warmup": "ramp the decay as `min(decay, (1 + n) / (10 + n))` over the first n updates",
    # [fsdp]
    "fsdp.reshard_after_forward": "free each block's gathered parameters after its forward (least memory); false: keep until backward",
    "fsdp.param_dtype": "compute dtype of the gathered parameters; unset: their own",
    "fsdp.reduce_dtype": "dtype of the gradient reduce-scatter; unset: the parameters'",
    "fsdp.cpu_offload": "keep the shards, gradients and optimizer state in CPU memory between uses",
    # [parallel]
    "parallel.tp": "tensor-parallel degree: ranks that share each layer; the data-parallel degree is the world size / tp",
    "parallel.tp_plan": "`package.module:fn` returning the model's `parallelize_module` plan; unset: the built-in plan of its class",
    "dist.timeout": "minutes a rank waits in a collective for its peers before the run fails, naming the rank it waited for and its phase",
    # [optimizer]
    "optimizer.name": "a `torch.optim` class (case-insensitive, e.g. \"AdamW\"); overrides `train.optimizer`",
    "optimizer.target": "`package.module:factory` called as `factory(param_groups, lr=..., **args)`",
    "optimizer.args": "the optimizer's other keyword arguments (`betas`, `eps`, ...)",
    "optimizer.decay_bias_and_norm": "true: one parameter group, everything decays; unset/false: biases and norm weights do not",
    # [scheduler]
    "scheduler.name": "built-in schedule after `train.warmup_steps` of warmup; overrides `train.scheduler`",
    "scheduler.target": "`package.module:factory` called as `factory(optimizer, **args)`",
    "scheduler.args": "the schedule's options (`step_size`, `milestones`, `gamma`, ...) or the target's arguments",
    # [log]
    "log.tensorboard": "also write the metrics as TensorBoard events under `<run_dir>/tensorboard/`",
    "log.mlflow": "present (`[log.mlflow]`): also send the metrics to MLflow",
    "log.mlflow.tracking_uri": "MLflow tracking URI; empty: `MLFLOW_TRACKING_URI`, else MLflow's own default (`mlflow.db` or `./mlruns`, by version)",
    "log.mlflow.experiment": "MLflow experiment; empty: the run's group",
    "log.wandb": "present (`[log.wandb]`): also send the metrics to Weights & Biases (files under `WANDB_DIR`, else `<run_dir>/wandb/`)",
    "log.wandb.project": "W&B project; empty: the run's group",
    "log.wandb.entity": "W&B entity (user or team); empty: `WANDB_ENTITY`, else your W&B default",
    "log.wandb.mode": "online, offline or disabled; empty: `WANDB_MODE`, else W&B's default (online)",
    # [[callbacks]]
    "callbacks": "`[[callbacks]]` tables: objects called at the trainer's moments, in order",
    "callbacks.target": "`package.module:Factory` building the callback",
    "callbacks.args": "keyword arguments of the callback's target",
    # top level
    "objective": "what a step computes: a built-in name or a `package.module:function` target",
    "checkpoint_format": "on-disk checkpoint format: standard (DCP), legacy (one file) or single (one file per save)",
    "resume_strict_state": "false: best-effort state restore on resume (casts dtypes; skips the loader cursor)",
}
