"""State a resume can load: what ``torch.load(weights_only=True)`` refuses is encoded, or refused at the save.

A checkpoint is read back with ``torch.load(weights_only=True)`` (it never runs code from a
file). That loader takes tensors, numbers, strings, bytes, ``None`` and plain containers;
anything else it refuses (a numpy value, an ``io.BytesIO``, a user class), so a save holding
one would be written, verified and never loaded. Here such state is made loadable or refused
before anything is written:

- numpy arrays and scalars (non-object dtypes) become ``{"__pimm_numpy__": {...}}`` entries
  holding their bytes as a ``uint8`` tensor, dtype and shape; :func:`decode` gives the same
  numpy values back (dtype, shape, bytes; a scalar stays a scalar);
- an ``io.BytesIO`` becomes ``{"__pimm_bytesio__": bytes}`` and is given back as one;
- a value of a class registered with ``torch.serialization.add_safe_globals`` is kept;
- anything else raises :class:`UnloadableStateError` naming where it is (:func:`encode`).

A module's extra state (``get_extra_state()``, e.g. TransformerEngine's FP8 metadata) that is
not a tensor is stored in the model's state dict as a ``uint8`` tensor: :data:`EXTRA_MAGIC`
followed by the ``torch.save`` bytes of the encoded object (:func:`encode_extra`), so
``weights.pth``, the DCP shards and exports hold tensors only (plain ``torch.load(weights_only=True)``
and safetensors read them); :func:`install_extra_state_codec` makes the model's
``state_dict()`` encode it and ``load_state_dict()`` give ``set_extra_state`` the original
object back (:func:`decode_extra_states` does it for a state dict loaded elsewhere).
"""

from __future__ import annotations

import collections
import io
import pickle
import re
from typing import Any

import numpy as np
import torch
from torch import nn

from ...errors import CheckpointError

NUMPY = "__pimm_numpy__"
BYTESIO = "__pimm_bytesio__"
#: The first bytes of a module's encoded extra state (then ``torch.save`` bytes).
EXTRA_MAGIC = b"PIMM-EXTRA-STATE\x00v1\n"
EXTRA_SUFFIX = nn.modules.module._EXTRA_STATE_KEY_SUFFIX  # "_extra_state"

_LEAVES = (str, int, float, bool, type(None), bytes, bytearray, complex, torch.dtype, torch.device, torch.Size)
_FIX = "return plain values (numbers, strings, lists, dicts, tensors, numpy arrays)"


class UnloadableStateError(CheckpointError):
    """State that ``torch.load(weights_only=True)`` could not read back (exit code 2: the code
    that made it must change). The message names the owner, the path in its state and the fix."""

    exit_code = 2


def encode(obj: Any, where: str = "") -> Any:
    """``obj`` with numpy values and ``io.BytesIO`` encoded (see the module docstring); a copy of
    its containers, the tensors and other leaves shared.

    Args:
        where: the path of ``obj`` in its owner's state, for the error (``['key'][0]``).

    Raises:
        UnloadableStateError: a value ``torch.load(weights_only=True)`` refuses that has no encoding
            (its path, class and the fix; the caller prefixes the owner).
    """
    t = type(obj)
    if isinstance(obj, torch.Tensor) or t in _LEAVES:
        return obj
    if t in (dict, collections.OrderedDict):
        out = t() if t is collections.OrderedDict else {}
        for k, v in obj.items():
            out[encode(k, f"{where} (a key)")] = encode(v, f"{where}[{k!r}]")
        return out
    if t in (list, tuple, set):
        return t(encode(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, (np.ndarray, np.generic)):
        return {NUMPY: _numpy_fields(obj, where)}
    if t is io.BytesIO:
        return {BYTESIO: obj.getvalue()}
    problem = _refused(obj)
    if problem is not None:
        raise UnloadableStateError(f"{where or 'the value'} {problem}")
    return obj  # a class the user registered with torch.serialization.add_safe_globals


def _numpy_fields(a: np.ndarray | np.generic, where: str) -> dict[str, Any]:
    arr = np.asarray(a)
    if arr.dtype.hasobject:
        raise UnloadableStateError(f"{where or 'the value'} is a numpy array of Python objects (dtype object), which "
                                   f"torch.load(weights_only=True) cannot read back; {_FIX}, e.g. .tolist()")
    data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return {"descr": np.lib.format.dtype_to_descr(arr.dtype), "shape": list(arr.shape),
            "data": torch.from_numpy(data.copy()), "scalar": isinstance(a, np.generic)}


def _refused(obj: Any) -> str | None:
    """Why ``torch.load(weights_only=True)`` would not read ``obj`` back, or None when it does."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except Exception as e:  # a lambda, a lock, an open file
        return (f"is a {_qualname(obj)}, which cannot be serialised ({e.__class__.__name__}); {_FIX} "
                "from state_dict()")
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except pickle.UnpicklingError as e:
        m = re.search(r"GLOBAL ([\w.]+)", str(e))
        short = (m.group(1) if m else _qualname(obj)).rsplit(".", 1)[-1]
        return (f"is a {_qualname(obj)}, which torch.load(weights_only=True) refuses; {_FIX} from state_dict(), "
                f"or call torch.serialization.add_safe_globals([{short}]) in the module that defines it")
    return None


def _qualname(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode` (containers rebuilt only where something was decoded)."""
    t = type(obj)
    if t in (dict, collections.OrderedDict):
        if len(obj) == 1 and NUMPY in obj and isinstance(obj[NUMPY], dict):
            f = obj[NUMPY]
            arr = np.frombuffer(f["data"].numpy().tobytes(), dtype=np.lib.format.descr_to_dtype(f["descr"]))
            arr = arr.reshape(f["shape"]).copy()
            return arr[()] if f.get("scalar") else arr
        if len(obj) == 1 and BYTESIO in obj and isinstance(obj[BYTESIO], (bytes, bytearray)):
            return io.BytesIO(bytes(obj[BYTESIO]))
        out = t() if t is collections.OrderedDict else {}
        for k, v in obj.items():
            out[k] = decode(v)
        return out
    if t in (list, tuple, set):
        return t(decode(v) for v in obj)
    return obj


# ---------------------------------------------------------------- modules' extra state
def encode_extra(value: Any, owner: str) -> torch.Tensor:
    """A module's extra state as a tensor: ``value`` itself when it is one, else a ``uint8``
    tensor of :data:`EXTRA_MAGIC` + ``torch.save(encode(value))``.

    Raises:
        UnloadableStateError: ``value`` holds something with no safe encoding (names ``owner``).
    """
    if isinstance(value, torch.Tensor):
        return value
    try:
        safe = encode(value, "get_extra_state()")
    except UnloadableStateError as e:
        raise UnloadableStateError(f"{owner}: {e}") from None
    buf = io.BytesIO()
    buf.write(EXTRA_MAGIC)
    torch.save(safe, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def decode_extra(value: Any) -> Any:
    """Inverse of :func:`encode_extra`: an encoded tensor gives the object back; anything else is returned as it is.

    Raises:
        pickle.UnpicklingError: the bytes after the marker hold what ``weights_only`` refuses.
    """
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
            and value.numel() > len(EXTRA_MAGIC)):
        return value
    raw = value.detach().cpu().numpy().tobytes()
    if not raw.startswith(EXTRA_MAGIC):
        return value
    return decode(torch.load(io.BytesIO(raw[len(EXTRA_MAGIC):]), weights_only=True, map_location="cpu"))


def is_extra_state_key(key: str) -> bool:
    """``key`` names a module's extra state in a state dict (its shape is not the model's to check)."""
    return key == EXTRA_SUFFIX or key.endswith("." + EXTRA_SUFFIX)


def decode_extra_states(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with each encoded extra state decoded (a new dict; for a model without the codec)."""
    return {k: decode_extra(v) if is_extra_state_key(k) else v for k, v in sd.items()}


def encode_extra_states(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` itself, or a copy with each non-tensor extra state encoded (a model without the codec).

    Raises:
        UnloadableStateError: an extra state with no safe encoding (names its module).
    """
    if all(isinstance(v, torch.Tensor) for v in sd.values()):
        return sd
    return {k: encode_extra(v, f"module `{k[:-len(EXTRA_SUFFIX)].rstrip('.') or '(the model)'}` (get_extra_state())")
            if is_extra_state_key(k) else v for k, v in sd.items()}


def extra_state_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules of ``model`` that define their own ``get_extra_state``."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).get_extra_state is not nn.Module.get_extra_state]


def _owner(name: str, module: nn.Module) -> str:
    return f"module `{name or '(the model)'}` ({type(module).__qualname__}.get_extra_state())"


def install_extra_state_codec(model: nn.Module) -> int:
    """Make ``model``'s ``state_dict()`` store each module's non-tensor extra state as an encoded
    tensor (:func:`encode_extra`) and ``load_state_dict()`` decode it before ``set_extra_state``.

    Idempotent. Returns the number of modules with extra state of their own.
    """
    mods = extra_state_modules(model)
    for name, module in mods:
        if getattr(module, "_pimm_extra_codec", False):
            continue

        def post(mod: nn.Module, sd: dict[str, Any], prefix: str, _meta: Any, name: str = name) -> None:
            key = prefix + EXTRA_SUFFIX
            if key in sd and not isinstance(sd[key], torch.Tensor):
                sd[key] = encode_extra(sd[key], _owner(name, mod))

        def pre(mod: nn.Module, sd: dict[str, Any], prefix: str, *_: Any) -> None:
            key = prefix + EXTRA_SUFFIX
            if key in sd:
                sd[key] = decode_extra(sd[key])

        module.register_state_dict_post_hook(post)
        module.register_load_state_dict_pre_hook(pre)
        module._pimm_extra_codec = True
    return len(mods)


def extra_state_problem(model: nn.Module) -> str | None:
    """Why some module's extra state could not be saved loadably (one line with its owner and the fix), or None."""
    for name, module in extra_state_modules(model):
        try:
            encode_extra(module.get_extra_state(), _owner(name, module))
        except UnloadableStateError as e:
            return str(e)
    return None


def state_problem(state: Any, owner: str) -> str | None:
    """Why ``state`` (an owner's ``state_dict()``) could not be saved loadably, in one line naming
    ``owner`` and the path in it, or None."""
    try:
        encode(state, "state_dict()")
    except UnloadableStateError as e:
        return f"{owner}: {e}"
    return None
