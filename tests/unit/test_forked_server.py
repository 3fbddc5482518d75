"""The ranks' fork server as a fork of the launcher (pimm_core/process/forkserver.py, ``fork_this``): the
launcher has imported torch, so the server starts without importing it again, and the children it forks
start as they would from a fresh interpreter: no file, signal handler or exit function of the launcher's,
and modules that read the environment at import imported again in the child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_PARENT = """
import atexit, fcntl, json, multiprocessing, os, signal, sys, tempfile
import torch  # (what the launcher has imported when it starts the server)
sys.path.insert(0, {here!r})
import envmod  # user code that reads the environment at import, as pimm_core.faults reads RANK
from pimm_core.process import forkserver

lock = open({lock!r}, "w")
fcntl.flock(lock, fcntl.LOCK_EX)  # the launcher's run lock
signal.signal(signal.SIGTERM, lambda *a: None)
atexit.register(envmod.at_exit)  # (user code's exit function: the child imports envmod again, with its own)
kept = tempfile.TemporaryDirectory(dir={here!r})  # removed by a finalizer at the launcher's exit

os.environ["PROBE"] = "the child's"
forkserver.start([], fork_this=True)
server = multiprocessing.forkserver._forkserver._forkserver_pid
import child
ctx = multiprocessing.get_context("forkserver")
queue = ctx.SimpleQueue()
proc = ctx.Process(target=child.probe, args=(queue,))
proc.start()
seen = queue.get()
proc.join()
seen.update(server_cmdline=open(f"/proc/{{server}}/cmdline").read(), own_cmdline=open("/proc/self/cmdline").read(),
            server_parent=int(open(f"/proc/{{server}}/stat").read().rsplit(")", 1)[1].split()[1]), parent=os.getpid(),
            exitcode=proc.exitcode, kept_exists=os.path.isdir(kept.name))
print(json.dumps(seen))
"""

_CHILD = """
import atexit, fcntl, os, signal, sys

def probe(queue):
    fresh = "envmod" not in sys.modules
    import envmod
    with open({lock!r}) as f:  # the launcher's lock: free to others once the launcher is gone, not held here
        held = sorted(os.readlink(f"/proc/self/fd/{{fd}}") for fd in os.listdir("/proc/self/fd")
                      if os.path.realpath(f"/proc/self/fd/{{fd}}") == os.path.realpath({lock!r}))
    queue.put({{"child": os.getpid(), "envmod_fresh": fresh, "envmod_probe": envmod.PROBE, "handles_sigterm": callable(signal.getsignal(
        signal.SIGTERM)), "lock_fds": len(held) - 1}})
    atexit._run_exitfuncs()  # (what a rank's exit runs: pimm_core.launch.rank_start._finalize)
    import weakref
    weakref.finalize._exitfunc()
"""


def test_a_forked_server_starts_children_as_from_a_fresh_interpreter(tmp_path: Path) -> None:
    paths = {"here": str(tmp_path), "lock": str(tmp_path / ".lock"), "marker": str(tmp_path / "marker")}
    exit_line = f"def at_exit():\n    open({paths['marker']!r}, 'a').write(f'{{__name__}} {{os.getpid()}}\\n')\n"
    (tmp_path / "envmod.py").write_text("import os\nPROBE = os.environ.get('PROBE', 'unset')\n" + exit_line)
    # a site hook (coverage's, a profiler's) runs in every fresh interpreter, and so in every child
    (tmp_path / "sitecustomize.py").write_text("import atexit, os\n" + exit_line + "atexit.register(at_exit)\n")
    (tmp_path / "child.py").write_text(_CHILD.format(**paths))
    out = subprocess.run([sys.executable, "-c", _PARENT.format(**paths)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # a fork of this process (same command line, its child), not a fresh `python -c ...forkserver main`
    assert seen["server_cmdline"] == seen["own_cmdline"] and seen["server_parent"] == seen["parent"], seen
    assert seen["exitcode"] == 0
    assert seen["envmod_fresh"] and seen["envmod_probe"] == "the child's", seen
    assert not seen["handles_sigterm"], seen
    assert seen["lock_fds"] == 0, seen
    # the child's exit ran the site hook's exit function, not the one the parent's user code registered
    # (multiprocessing's resource tracker, a fresh interpreter, runs the site hook too: not counted)
    lines = sorted(line for line in (tmp_path / "marker").read_text().splitlines()
                   if int(line.split()[1]) in (seen["parent"], seen["child"]))
    assert lines == sorted([f"envmod {seen['parent']}", f"sitecustomize {seen['parent']}",
                            f"sitecustomize {seen['child']}"]), lines
    assert seen["kept_exists"], seen
