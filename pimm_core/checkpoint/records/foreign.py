"""What a file or directory is when pimm did not write it (torch-free, runs nothing).

A resume or warm-start source that is not a pimm checkpoint gets one line saying what
it is and what to do with it. This module names it from the bytes alone:

========================================================  ===================================
source                                                    named
========================================================  ===================================
a directory with ``optimizer.bin``, ``scheduler.bin``,    an Accelerate ``save_state``
``random_states_<i>.pkl``, ``scaler.pt``...               directory (weights:
                                                          ``model.safetensors`` or
                                                          ``pytorch_model.bin``)
a directory with ``config.json`` and                      a Hugging Face model directory
``model.safetensors`` / ``pytorch_model.bin`` (or a
sharded ``*.index.json``)
a directory with ``export.json``                          a pimm export (weights only)
a ``torch.save`` file whose pickle names                  a PyTorch Lightning checkpoint
``pytorch-lightning_version``
a ``torch.save`` file of an ``OrderedDict`` without a     a plain PyTorch state dict
``state_dict`` key
anything that is neither a ``torch.save`` file            not a PyTorch checkpoint (text,
(zip with ``data.pkl``, or the legacy pickle with         a Python pickle, a zip archive,
torch's magic number) nor safetensors                     unrecognised bytes, empty)
========================================================  ===================================

Nothing is unpickled: a ``torch.save`` file's ``data.pkl`` is only walked opcode by opcode
with :func:`pickletools.genops` (which never builds an object) to find its string
constants and first global.
"""

from __future__ import annotations

import pickletools
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

#: What torch.save's legacy (non-zip) format starts with: protocol 2, then the magic number as LONG1.
_TORCH_LEGACY_HEAD = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
_SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header (bytes)
_SCAN_BYTES = 4 << 20  # enough of data.pkl to see a checkpoint's top-level keys

ACCELERATE_STATE = re.compile(r"^(optimizer(_\d+)?\.bin|scheduler(_\d+)?\.bin|sampler(_\d+)?\.bin|"
                              r"random_states_\d+\.pkl|scaler\.pt|custom_checkpoint_\d+\.pkl)$")
SAFETENSORS = "model.safetensors"  # an export's (and a Hugging Face directory's) weights
BIN = "model.bin"  # an export's weights with --format bin, before exports took Hugging Face's name
HF_BIN = "pytorch_model.bin"  # a Hugging Face directory's (and an export's) torch.save weights
EXPORT_FILES = (SAFETENSORS, HF_BIN, BIN)
HF_WEIGHTS = (SAFETENSORS, HF_BIN)
HF_SHARD_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass
class Sniffed:
    """What a file's bytes are.

    Attributes:
        kind: ``torch`` (zip ``torch.save``), ``torch-legacy``, ``safetensors``, ``pickle``
            (a Python pickle that is not a ``torch.save`` file), ``zip`` (not a torch
            archive), ``text``, ``empty`` or ``data`` (unrecognised bytes).
        strings: string constants of the pickle (``torch`` only, first few MB).
        first_global: ``"module name"`` of the pickle's first global (``torch`` only).
    """

    kind: str
    strings: frozenset[str] = frozenset()
    first_global: str | None = None

    @property
    def is_pytorch(self) -> bool:
        return self.kind in ("torch", "torch-legacy", "safetensors")

    @property
    def not_a_checkpoint(self) -> bool:
        """Neither PyTorch nor a pickle: text, unrecognised bytes, an empty file, a zip archive.

        (A plain pickle is left to the weights-only unpickler, whose refusal names the
        operand or global that makes it unreadable, or that would have run code.)
        """
        return self.kind in ("text", "data", "empty", "zip")

    def describe(self) -> str:
        """A few words for an error message: ``a text file``, ``unrecognised bytes``..."""
        return {"pickle": "a Python pickle that torch.save did not write", "zip": "a zip archive without data.pkl",
                "text": "a text file", "empty": "an empty file", "data": "unrecognised bytes",
                "torch": "a torch.save file", "torch-legacy": "a torch.save file (legacy format)",
                "safetensors": "a safetensors file"}[self.kind]


def sniff(path: Path) -> Sniffed:
    """Classify the file at ``path`` from its first bytes (and, for a torch zip, its pickle's opcodes).

    Raises:
        OSError: the file cannot be read.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(4096)
    if not head:
        return Sniffed("empty")
    if head.startswith(b"PK\x03\x04"):
        return _sniff_zip(path)
    if head.startswith(_TORCH_LEGACY_HEAD):
        return Sniffed("torch-legacy")
    if is_safetensors_head(head, path.stat().st_size):
        return Sniffed("safetensors")
    if head[:1] == b"\x80" and 2 <= head[1] <= 5:
        return Sniffed("pickle")
    if _is_text(head):
        return Sniffed("text")
    return Sniffed("data")


def is_safetensors_head(head: bytes, size: int) -> bool:
    """Whether ``head`` (a file's first bytes; ``size``: the file's size in bytes) starts a safetensors file.

    The format (huggingface/safetensors, "Format"): a little-endian u64 N, then an N-byte JSON
    header that starts with ``{``, then the tensor data. N must fit in the file and, as the
    library itself enforces, be under 100 MB: a random file whose ninth byte is ``{`` is not one.
    """
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= min(size - 8, _SAFETENSORS_MAX_HEADER)


def _is_text(head: bytes) -> bool:
    if b"\x00" in head:
        return False
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the end of the sample
            return False
        text = head[:e.start].decode("utf-8")
    return all(c.isprintable() or c in "\t\r\n\f" for c in text)


def _sniff_zip(path: Path) -> Sniffed:
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not names:
                return Sniffed("zip")
            with z.open(names[0]) as f:
                data = f.read(_SCAN_BYTES)
    except (zipfile.BadZipFile, OSError, RuntimeError, ValueError, NotImplementedError):
        return Sniffed("torch")  # torch's own reader says what is wrong with the archive
    strings: set[str] = set()
    first_global = None
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL" and first_global is None:
                first_global = str(arg)
            elif isinstance(arg, str) and len(arg) < 200:
                strings.add(arg)
            if op.name == "STOP":
                break
    except Exception:  # a cut-off sample or a damaged pickle: what was seen so far is enough
        pass
    return Sniffed("torch", frozenset(strings), first_global)


def file_layout(path: Path, sniffed: Sniffed | None = None) -> str | None:
    """A name for a ``torch.save`` file pimm did not write, or None.

    Returns:
        ``"a PyTorch Lightning checkpoint"``, ``"a plain PyTorch state dict"`` or None
        (a pimm file, or nothing recognisable).
    """
    s = sniffed or sniff(path)
    if s.kind != "torch":
        return None
    if "pytorch-lightning_version" in s.strings or {"state_dict", "optimizer_states", "loops"} <= s.strings:
        return "a PyTorch Lightning checkpoint"
    if "state_dict" not in s.strings and "format" not in s.strings and s.first_global == "collections OrderedDict":
        return "a plain PyTorch state dict"
    return None


@dataclass
class ForeignDir:
    """A directory another tool wrote.

    Attributes:
        what: e.g. ``"an Accelerate save_state directory"``.
        weights: its model weights file, when it has exactly one pimm can read.
        note: why it has none (sharded weights...), else None.
    """

    what: str
    weights: Path | None
    note: str | None = None


def directory_layout(d: Path) -> ForeignDir | None:
    """Name a directory that is not a pimm checkpoint (see the module docstring), or None."""
    d = Path(d)
    try:
        names = {p.name for p in d.iterdir()}
    except OSError:
        return None
    weights = next((d / n for n in HF_WEIGHTS if n in names), None)
    sharded = next((n for n in HF_SHARD_INDEX if n in names), None)
    note = None
    if weights is None and sharded:
        note = f"its weights are sharded ({sharded}); pimm reads one file: merge the shards into one first"
    if "export.json" in names:
        return ForeignDir("a pimm export (weights only)", next((d / n for n in EXPORT_FILES if n in names), None))
    if any(ACCELERATE_STATE.match(n) for n in names):
        if weights is None and note is None:
            note = "it holds no model.safetensors or pytorch_model.bin"
        return ForeignDir("an Accelerate save_state directory", weights, note)
    if "config.json" in names and (weights is not None or sharded):
        return ForeignDir("a Hugging Face model directory", weights, note)
    return None


def not_a_checkpoint(path: Path, what: str) -> str:
    """The one line for a file that is not a PyTorch checkpoint (``what``: e.g. ``a text file``)."""
    return (f"{path} is not a PyTorch checkpoint ({what}); pass a file written by torch.save or safetensors: "
            "a pimm checkpoint (a run's model/last, model_best.pth...), an export directory, or a state dict")


KEY_RULES_EXAMPLE = "train.key_rules = [['^model\\.', '']]"


def why_not_resumable(p: Path) -> str | None:
    """The refusal for ``--train.resume-from p`` when ``p`` is something pimm cannot resume, or None.

    Covers the foreign layouts of the module docstring and files that are not PyTorch
    checkpoints; None means ``p`` may be a pimm checkpoint (its own checks decide).
    """
    p = Path(p)
    if p.is_dir():
        found = directory_layout(p)
        if found is None:
            return None
        if found.weights is None:
            return f"{p} is {found.what}, not a pimm checkpoint, and cannot resume a run; {found.note}"
        if found.what.startswith("a pimm export"):
            return (f"{p} is {found.what} and cannot resume a run; warm-start a new run from it with "
                    f"--train.weight {p}")
        state = " (pimm cannot restore its optimizer, scheduler and RNG state)" if "Accelerate" in found.what else ""
        return (f"{p} is {found.what}, not a pimm checkpoint, and cannot resume a run{state}; warm-start a new run "
                f"from its weights with --train.weight {found.weights} (rename keys that differ with "
                "train.key_rules)")
    try:
        s = sniff(p)
    except OSError:
        return None
    if not s.is_pytorch:
        return (f"{p} is not a PyTorch checkpoint ({s.describe()}); --train.resume-from takes a pimm checkpoint: "
                "a run's model/last, its model/ directory, model_last.pth or step_<N>.pth")
    layout = file_layout(p, s)
    if layout == "a PyTorch Lightning checkpoint":
        return (f"{p} is {layout}, not a pimm checkpoint, and cannot resume a run (pimm cannot restore Lightning's "
                f"loop and optimizer state); warm-start a new run with --train.weight {p} and strip the "
                f"LightningModule's attribute prefix from its keys with train.key_rules, e.g. {KEY_RULES_EXAMPLE}")
    if layout is not None or s.kind == "safetensors":
        what = layout or "a safetensors file"
        return (f"{p} is {what} (weights only), not a pimm checkpoint, and cannot resume a run; warm-start a new "
                f"run with --train.weight {p} (rename keys that differ with train.key_rules)")
    return None
