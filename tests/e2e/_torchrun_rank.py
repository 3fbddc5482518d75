"""What each rank forked by ``_torchrun.py`` runs: ``python SCRIPT ARGS`` (``sys.argv[1:]``)."""

import sys

if __name__ == "__main__":
    from pimm_core.launch.rank_start import run_rank

    run_rank(sys.argv[2:], script=sys.argv[1])
