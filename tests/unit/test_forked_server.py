"""The ranks' fork server as a fork of the launcher (pimm_core/process/forkserver.py, ``fork_this``): the
launcher has imported torch, so the server starts without importing it again, and the children it forks
start as they would from a fresh interpreter: no file, signal handler or exit function of the launcher's,
and pimm's modules, which read the environment at import, imported again in the child. A launcher that
has imported user code (a config's target) starts a fresh interpreter as its server instead: that code
is neither inherited (read at the launcher's import) nor imported twice beside what it registered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# (in each parent script) the child started from the server, and what it saw
_PROBE_CHILD = """\
import child
ctx = multiprocessing.get_context("forkserver")
queue = ctx.SimpleQueue()
proc = ctx.Process(target=child.probe, args=(queue,))
proc.start()
seen = queue.get()
proc.join()
"""

_PARENT = """
import fcntl, json, multiprocessing, os, signal, sys, tempfile
import torch  # (what the launcher has imported when it starts the server)
sys.path.insert(0, {here!r})
import pimm_core.faults  # pimm's: reads the environment (PIMM_FAILPOINT) at import
if {user!r}:
    import usermod  # user code: a config's target, imported by the launcher to check it
from pimm_core.process import forkserver

lock = open({lock!r}, "w")
fcntl.flock(lock, fcntl.LOCK_EX)  # the launcher's run lock
signal.signal(signal.SIGTERM, lambda *a: None)
kept = tempfile.TemporaryDirectory(dir={here!r})  # removed by a finalizer at the launcher's exit

os.environ["PIMM_FAILPOINT"] = os.environ["PROBE"] = "the child's"
forkserver.start([], fork_this=True)
server = multiprocessing.forkserver._forkserver._forkserver_pid
user = forkserver.user_modules()
{probe_child}seen.update(server_cmdline=open(f"/proc/{{server}}/cmdline").read(),
            own_cmdline=open("/proc/self/cmdline").read(),
            server_parent=int(open(f"/proc/{{server}}/stat").read().rsplit(")", 1)[1].split()[1]), parent=os.getpid(),
            exitcode=proc.exitcode, kept_exists=os.path.isdir(kept.name), user_modules=user)
print(json.dumps(seen))
"""

_CHILD = """
import atexit, fcntl, os, signal, sys

def probe(queue):
    fresh = "pimm_core.faults" not in sys.modules
    import pimm_core.faults
    import torch
    import usermod
    with open({lock!r}) as f:  # the launcher's lock: free to others once the launcher is gone, not held here
        held = sorted(os.readlink(f"/proc/self/fd/{{fd}}") for fd in os.listdir("/proc/self/fd")
                      if os.path.realpath(f"/proc/self/fd/{{fd}}") == os.path.realpath({lock!r}))
    phases = [c for c in torch.serialization.get_safe_globals() if getattr(c, "__qualname__", "") == "Phase"]
    queue.put({{"child": os.getpid(), "faults_fresh": fresh, "faults_spec": pimm_core.faults._SPEC,
               "usermod_probe": usermod.PROBE, "phases": len(phases), "phase_is_usermods": phases == [usermod.Phase],
               "handles_sigterm": callable(signal.getsignal(signal.SIGTERM)), "lock_fds": len(held) - 1}})
    atexit._run_exitfuncs()  # (what a rank's exit runs: pimm_core.launch.rank_start._finalize)
    import weakref
    weakref.finalize._exitfunc()
"""

# user code that reads the environment at import and registers a class with torch (what a stream's state
# holding an enum needs to be resumed: tests/e2e/userpkg/stream.py)
_USERMOD = """
import enum, os, torch
PROBE = os.environ.get("PROBE", "unset")

class Phase(enum.Enum):
    WARMUP = "warmup"

torch.serialization.add_safe_globals([Phase])
"""


def _run(tmp_path: Path, *, user: bool) -> dict:
    paths = {"here": str(tmp_path), "lock": str(tmp_path / ".lock"), "marker": str(tmp_path / "marker")}
    exit_line = f"def at_exit():\n    open({paths['marker']!r}, 'a').write(f'{{__name__}} {{os.getpid()}}\\n')\n"
    # a site hook (coverage's, a profiler's) runs in every fresh interpreter, and so in every child
    (tmp_path / "sitecustomize.py").write_text("import atexit, os\n" + exit_line + "atexit.register(at_exit)\n")
    (tmp_path / "usermod.py").write_text(_USERMOD)
    (tmp_path / "child.py").write_text(_CHILD.format(**paths))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("PIMM_FAILPOINT", None)
    script = _PARENT.format(**paths, user=user, probe_child=_PROBE_CHILD)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["exitcode"] == 0
    # the child's own environment, as read at a fresh import; one class of the user's, the one it imported
    assert seen["faults_fresh"] and seen["faults_spec"] == "the child's", seen
    assert seen["usermod_probe"] == "the child's" and seen["phases"] == 1 and seen["phase_is_usermods"], seen
    assert not seen["handles_sigterm"], seen
    assert seen["lock_fds"] == 0, seen
    assert seen["kept_exists"], seen
    seen["markers"] = sorted(line for line in (tmp_path / "marker").read_text().splitlines()
                             if int(line.split()[1]) in (seen["parent"], seen["child"]))
    return seen


def test_a_forked_server_starts_children_as_from_a_fresh_interpreter(tmp_path: Path) -> None:
    seen = _run(tmp_path, user=False)
    assert seen["user_modules"] == [], seen
    # a fork of this process (same command line, its child), not a fresh `python -c ...forkserver main`
    assert seen["server_cmdline"] == seen["own_cmdline"] and seen["server_parent"] == seen["parent"], seen
    # the child's exit ran the site hook's exit function once, its own (multiprocessing's resource
    # tracker, a fresh interpreter, runs the site hook too: not counted)
    assert seen["markers"] == sorted([f"sitecustomize {seen['parent']}", f"sitecustomize {seen['child']}"]), seen


def test_a_launcher_that_imported_user_code_starts_a_fresh_server(tmp_path: Path) -> None:
    """Seen: a stream's enum registered with add_safe_globals by the launcher's import and again by the
    child's: a resume unpickled the launcher's class, not the child's, now and then (a set's order)."""
    seen = _run(tmp_path, user=True)
    assert seen["user_modules"] == ["usermod"], seen
    assert seen["server_cmdline"] != seen["own_cmdline"], seen  # `python -c 'from multiprocessing.forkserver ...'`
    assert "forkserver" in seen["server_cmdline"], seen


_EARLY = """
import json, multiprocessing, os, sys, time
import torch
sys.path.insert(0, {here!r})
from pimm_core.process import forkserver

if {stop_first!r}:  # a launch that ends before its ranks start (its config refused): the waiting server ends too
    assert forkserver.fork([])
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    t0 = time.monotonic()
    forkserver.stop()
    print(json.dumps({{"stopped_in": time.monotonic() - t0, "server_gone": not os.path.exists(f"/proc/{{server}}")}}))
    sys.exit(0)
assert forkserver.fork([])  # before the launcher imports the config's code
before = set(sys.modules)
import usermod  # the config's target: user code
import xxhash  # what it imports from an installed package
forkserver.preload_more(forkserver.installed_since(before))
{probe_child}print(json.dumps(seen))
"""

_EARLY_CHILD = """
import sys

def probe(queue):
    queue.put({"xxhash": "xxhash" in sys.modules, "usermod": "usermod" in sys.modules,
               "child_of_fork": True})
"""


def test_a_server_forked_before_user_code_preloads_the_installed_packages_it_imported(tmp_path: Path) -> None:
    """The launcher forks the ranks' server before it imports a config's user code; the installed packages that
    code imported (transformers for a Hugging Face model) are imported by the server before its first child, so
    each rank does not import them again; the user's module itself is not."""
    (tmp_path / "usermod.py").write_text(_USERMOD)
    (tmp_path / "child.py").write_text(_EARLY_CHILD)
    script = _EARLY.format(here=str(tmp_path), stop_first=False, probe_child=_PROBE_CHILD)
    out = subprocess.run([sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"xxhash": True, "usermod": False, "child_of_fork": True}, seen


def test_a_server_waiting_for_its_preload_list_stops_with_the_launch(tmp_path: Path) -> None:
    script = _EARLY.format(here=str(tmp_path), stop_first=True, probe_child=_PROBE_CHILD)
    out = subprocess.run([sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["server_gone"], seen  # (stop() waits for it: no deadlock on the pipe it was reading)


def test_the_launchers_main_module_is_not_user_code_under_multiprocessings_name_either(tmp_path: Path) -> None:
    """``import multiprocessing`` names ``__main__`` ``__mp_main__`` too: for ``python -m pimm_core.cli`` from a
    source checkout (a file outside the installation) that name counted as user code, and the launcher never
    forked the ranks' server (a fresh interpreter imported torch again)."""
    script = tmp_path / "launcher.py"
    script.write_text("import json, multiprocessing, sys\nfrom pimm_core.process import forkserver\n"
                      "mains = sorted(m for m in sys.modules if m.endswith('main__'))\n"
                      "print(json.dumps([mains, forkserver.user_modules()]))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    mains, user = json.loads(out.stdout.strip().splitlines()[-1])
    assert "__mp_main__" in mains and user == [], (mains, user)


def test_in_a_rank_the_launchers_main_module_under_multiprocessings_name_is_not_user_code(tmp_path: Path) -> None:
    """A rank forked from the launcher's server runs its own script as ``__main__`` and still holds the
    launcher's as ``__mp_main__`` (``python -m pimm_core.cli`` from a checkout: a file outside the
    installation). That counted as user code, so every rank with DataLoader workers started their fork
    server as a fresh interpreter that imported torch again (~1.2 CPU-s a rank); a module the user's
    code imported is still user code there."""
    (tmp_path / "launcher.py").write_text("")
    (tmp_path / "usermod.py").write_text("")
    script = tmp_path / "rank.py"
    script.write_text("import importlib.util, json, sys\nfrom pimm_core.process import forkserver\n"
                      f"spec = importlib.util.spec_from_file_location('__mp_main__', {str(tmp_path / 'launcher.py')!r})\n"
                      "sys.modules['__mp_main__'] = importlib.util.module_from_spec(spec)\n"
                      "spec.loader.exec_module(sys.modules['__mp_main__'])\n"
                      "before = forkserver.user_modules()\n"
                      "import usermod\n"
                      "print(json.dumps([before, forkserver.user_modules()]))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert (before, after) == ([], ["usermod"]), (before, after)
