"""``python -m pimm_core.utils.path latest-checkpoint MODEL_DIR [--explain]``

Prints the checkpoint a resume would load (the same selection as
``pimm checkpoints latest``); exit 1 when there is none. Torch-free.
"""

from __future__ import annotations

import sys

from ..cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "latest-checkpoint":
        print("usage: python -m pimm_core.utils.path latest-checkpoint MODEL_DIR [--explain]", file=sys.stderr)
        return 2
    return cli_main(["checkpoints", "latest", *argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
