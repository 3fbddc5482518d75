"""``pimm config show``: the config a launch would use, resolved, as TOML."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError
from ._common import Command

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Show configs as pimm resolves them.")


@app.command("show", cls=Command, context_settings={"allow_interspersed_args": False})
def config_show(
    config: Optional[Path] = typer.Option(None, "--train.config", help="TOML config file (required)."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Config overrides after --, e.g. -- train.epochs=3"),
) -> None:
    """Print the resolved config (file + overrides + defaults) as TOML; every key is listed, a
    value that differs from the default is marked. With train.strategy = "fsdp" (or train.blocks
    set), also the modules train.blocks matches (the model is built: this imports torch)."""
    from ..config import load_config
    from ..config.show import render

    if config is None:
        raise UsageError("pimm config show needs --train.config FILE (e.g. --train.config configs/digits.toml)")
    cfg = load_config(config, list(overrides or []))
    print(render(cfg), end="")
    if cfg.train.strategy == "fsdp" or cfg.train.blocks:
        from ..train.build import build_model
        from ..train.parallel import check_blocks

        model = build_model(cfg, config)
        names = {id(m): n for n, m in model.named_modules()}
        blocks = check_blocks(model, cfg, config)
        unit = "FSDP unit" if cfg.train.strategy == "fsdp" else "block"
        print(f"\n# train.blocks matched {len(blocks)} module(s), each a {unit} (then the root):")
        for m in blocks:
            print(f"#   {names[id(m)]} ({type(m).__name__})")
