"""``python -m pimm_core.cli``: the ``pimm`` command (torchrun starts each rank this way)."""

from . import run

if __name__ == "__main__":
    run()
