"""The script torchrun runs in each rank forked by the launcher (``--run-path``; see
:mod:`pimm_core.launch.rank_start`): ``pimm`` with the rank's arguments."""

import sys

if __name__ == "__main__":
    from pimm_core.launch.rank_start import run_rank

    run_rank(sys.argv[2:], environ=sys.argv[1])  # (torchrun_args puts the environment's change first)
