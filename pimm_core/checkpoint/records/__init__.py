"""What pimm writes and recognizes on disk (torch-free): ``manifest.json``, a generation read whole,
files pimm did not write, outputs the user names, pimm's scratch directories.

May import: ``errors``, ``fsio``, ``faults``, ``run.layout``; inside ``checkpoint`` nothing (the bottom).
"""
