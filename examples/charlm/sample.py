"""Generate text from trained char-LM weights.

    uv run python -m examples.charlm.sample exp/charlm/<run>/model/last --config configs/charlm.toml
    uv run python -m examples.charlm.sample exp/charlm/<run>/model/last --config configs/charlm.toml --weights ema
    uv run python -m examples.charlm.sample <export dir> --config configs/charlm.toml -n 400

The weights are any source ``pimm_core.load_weights`` reads (a run's ``model/last``, a
``best`` pointer, an export directory...); the model is built from the config's
``model.target`` and ``[model.args]``. An export holds one weight set (the one
``pimm export --weights`` chose), read as ``--weights raw``, the default.
"""

from __future__ import annotations

import argparse

import torch

from pimm_core import load_config, load_weights
from pimm_core.models import model_spec
from pimm_core.targets import call

from .model import generate


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m examples.charlm.sample", description=__doc__.splitlines()[0])
    p.add_argument("weights_source", help="checkpoint, pointer or export to load")
    p.add_argument("--config", default="configs/charlm.toml", help="the config the model was trained with")
    p.add_argument("--weights", default="raw", choices=["raw", "ema"], help="which weight set of a checkpoint (an export has only raw)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("-n", type=int, default=300, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = load_config(a.config)
    model = call(model_spec(cfg.model), config_path=a.config)
    load_weights(model, a.weights_source, weights=a.weights)
    text = generate(model, a.prompt, a.n, temperature=a.temperature, top_k=a.top_k,
                    generator=torch.Generator().manual_seed(a.seed))
    print(text)
    return text


if __name__ == "__main__":
    main()
