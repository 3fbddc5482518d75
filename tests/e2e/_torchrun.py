"""``torchrun`` for the tests, with its ranks forked from a fork server that has imported torch once.

    python tests/e2e/_torchrun.py [torchrun's flags] SCRIPT [ARGS ...]

does what ``python -m torch.distributed.run`` with the same arguments does, except how each rank
starts: as ``pimm launch`` starts its ranks (:mod:`pimm_core.launch.rank_start`), forked from a
server that preloaded torch, ``torch.distributed`` and DCP, instead of a fresh interpreter that
imports them (3-4 CPU-s a rank, and again at every restart). The rank then runs SCRIPT as
``python SCRIPT ARGS`` would (:func:`~pimm_core.launch.rank_start.run_rank`): what the tests check
(rendezvous, process groups, kills, torchrun's restarts) is torchrun's and the ranks' own; only the
imports are shared. ``PIMM_RANK_START=exec`` runs plain torchrun.
"""

import sys
from pathlib import Path

RANK_SCRIPT = Path(__file__).with_name("_torchrun_rank.py")


def main(argv: list[str]) -> None:
    from torch.distributed.run import get_args_parser, run

    from pimm_core.launch.rank_start import forked_ranks, rank_server

    args = get_args_parser().parse_args(argv)
    with rank_server(forked_ranks() and not args.module and not args.no_python) as forked:
        if forked:
            args.start_method, args.run_path = "forkserver", True
            args.training_script_args = [args.training_script, *args.training_script_args]
            args.training_script = str(RANK_SCRIPT)
        run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
