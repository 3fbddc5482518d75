"""``pimm export``: write a portable model directory from a run's checkpoint.

The command's torch import happens only when it runs.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Literal, Optional

import typer

from ._common import Command

app = typer.Typer()


@app.command("export", cls=Command)
def export_cmd(
    checkpoint: str = typer.Argument(
        ..., metavar="CHECKPOINT",
        help="Checkpoint of --run-dir (last, best, final, iter_<step>), or a path / hf://org/repo / s3://..."),
    out_dir: str = typer.Argument(..., metavar="OUT_DIR",
                                  help="Directory to create (must not exist or be empty), or a remote prefix "
                                       "(s3://bucket/out: export.json is written last, the export's marker)."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run directory exp/<group>/<run>."),
    weights: Literal["raw", "ema"] = typer.Option("raw", "--weights", help="Weight set."),
    fmt: Literal["safetensors", "bin"] = typer.Option("safetensors", "--format", help="File format."),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR when it is a previous export."),
) -> None:
    """Export a checkpoint's weights (model.safetensors or pytorch_model.bin, config.json: the training
    config, export.json); a transformers model as its own save_pretrained writes it (its config.json,
    weights, shards) with the training config as pimm_config.json."""
    import json

    from ..checkpoint.export.model_dir import EXPORT_JSON, export
    from ..checkpoint.remote.source import is_store_url, open_url, store_errors

    from ..run.entries import writable_error

    try:
        out = export(checkpoint, out_dir, weights=weights, fmt=fmt, run_dir=run_dir, force=force)
    except OSError as e:  # a destination pimm cannot write: one line naming its directory
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise writable_error(Path(e.filename).parent if e.filename else Path(out_dir).parent, e,
                             hint="choose another OUT_DIR") from None
    if is_store_url(out):
        fs, path = open_url(str(out))
        with store_errors(str(out)):
            rec = json.loads(fs.cat_file(f"{path}/{EXPORT_JSON}"))
    else:
        rec = json.loads((Path(out) / EXPORT_JSON).read_text(encoding="utf-8"))
    step = f"step {rec['step']}, " if rec.get("step") is not None else ""
    files = [*(rec.get("files") or [rec["file"]]), *([rec["config"]] if rec.get("config") else []), EXPORT_JSON]
    if rec.get("library"):
        files.insert(0, "config.json")
    ties = f", {len(rec['aliases'])} tied" if rec.get("aliases") else ""
    print(f"exported {checkpoint} ({step}{rec['weights']} weights, {rec['num_tensors']} tensors{ties}) "
          f"from {rec['source']} to {out}: {', '.join(files)}")
