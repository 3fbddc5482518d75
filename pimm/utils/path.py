"""``python -m pimm.utils.path latest-checkpoint MODEL_DIR [--explain]``: alias of
:mod:`pimm_core.utils.path` (the spelling of the reference documentation)."""

import sys

from pimm_core.utils.path import main

if __name__ == "__main__":
    sys.exit(main())
