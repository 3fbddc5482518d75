"""What the checkpoint a resume would load recorded vs. the planned resume, and the policy row (torch-free).

:func:`resume_diff` compares world size, strategy, per-rank batching and workers, config, code and
torch version and the data fingerprint, and applies :func:`pimm_core.run.topology.plan_resume`.
``pimm checkpoints diff`` prints :meth:`ResumeDiff.lines`; the console's Topology view
renders the same rows (:meth:`ResumeDiff.policy_rows`) with colours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint.select.selection import explain as explain_candidates
from ..checkpoint.select.selection import select_resume
from ..config import read_saved_config
from ..errors import CheckpointError, ConfigError, UsageError
from ..run.layout import CONFIG, MODEL, check_run_dir
from ..run.provenance import current_code_version, read_provenance, recorded_launch, recorded_world_size

DIFF_ROWS = (("world_size", "world size"), ("strategy", "strategy"), ("batch_size", "per-rank micro-batch"),
             ("grad_accum", "accumulation window"), ("workers_per_rank", "per-rank workers"),
             ("code_version", "code version"), ("torch_version", "torch version"),
             ("data_fingerprint", "data fingerprint"), ("data_length", "train samples"))

#: What the planned side shows for a value only a launch knows (it loads the data to hash it).
PLANNED_AT_LAUNCH = {"data_fingerprint": "computed at launch", "data_length": "computed at launch"}


def planned_text(key: str, v: Any) -> str:
    """The planned side of a diff row: the value, or why there is none (``computed at launch``)."""
    if v is None:
        return PLANNED_AT_LAUNCH.get(key, "unknown")
    return str(v)


def _show(v: Any, planned: bool = False, key: str = "") -> str:
    if v is None:
        return f"({planned_text(key, v)})" if planned else "-"
    return str(v)


def plan_rows(plan: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """A resume plan (:meth:`pimm_core.run.topology.ResumePlan.to_json`, None for a weights-only
    file) as ``(label, text, tone)`` rows: ``policy``, ``restore``, ``discard``, ``replay
    boundary``, one ``warning`` each. ``tone`` is ``plain``, ``info``, ``ok``, ``bad`` or
    ``warn`` (how the console colours the text)."""
    if plan is None:
        return [("policy", "weights only: this file cannot resume a run (warm-start with --train.weight)", "plain")]
    p = plan
    rows = [("policy", p["description"], "info"),
            ("restore", ", ".join(p["restored"]), "ok"),
            ("discard", ", ".join(p["discarded"]) or "nothing", "bad" if p["discarded"] else "ok")]
    rb = p.get("replay_boundary")
    if rb:
        rows.append(("replay boundary", f"epoch {rb['epoch']} restarts at step {rb['step']}; "
                     f"the {rb['from_iter']} batches already run in that epoch train again", "warn"))
    else:
        changed = "parallel layout" if p.get("row") == "layout" else "strategy"
        why = ("exact continuation" if p["exact"] else f"loader cursor restored; not bitwise: the {changed} changed"
               if p.get("restore_cursor") else "global data order: the samples consumed are kept"
               if p.get("row") == "global_order" else "nothing to replay")
        rows.append(("replay boundary", f"none ({why}) "
                     f"at step {p['step']}, epoch {p['epoch']}, iter {p['iter']}", "ok"))
    rows += [("warning", w, "warn") for w in p.get("warnings", [])]
    return rows


@dataclass
class ResumeDiff:
    """What a checkpoint recorded vs. a planned resume, and the policy row that applies.

    Attributes:
        candidate: the checkpoint compared (a resume's choice unless one was named).
        selected_by: ``resume`` (what ``--train.resume`` would load) or ``name``.
        recorded, planned: ``world_size``, ``strategy`` (recorded: ``ddp`` for a checkpoint
            written before manifests recorded it), ``workers_per_rank``, ``code_version``,
            ``torch_version``, ``data_fingerprint`` (planned: None where only a launch knows:
            the data fingerprint, which the launch computes as it loads the data).
        config_diff: ``key: saved -> planned`` lines (:func:`pimm_core.run.topology.config_diff`).
        plan: :class:`pimm_core.run.topology.ResumePlan` as JSON, or None (weights-only file).
        notes: lines on what could not be compared and why.
    """

    run_dir: str
    candidate: dict[str, Any]
    selected_by: str
    recorded: dict[str, Any]
    planned: dict[str, Any]
    config_diff: list[str]
    plan: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": 1, "run_dir": self.run_dir, "candidate": self.candidate,
                "selected_by": self.selected_by, "recorded": self.recorded, "planned": self.planned,
                "config_diff": self.config_diff, "plan": self.plan, "notes": self.notes}

    def policy_rows(self) -> list[tuple[str, str, str]]:
        """:func:`plan_rows` of the plan, then one ``note`` row (tone ``dim``) per note."""
        return plan_rows(self.plan) + [("note", n, "dim") for n in self.notes]

    def lines(self) -> list[str]:
        """The human report (``pimm checkpoints diff``)."""
        c = self.candidate
        out = [f"checkpoint: {c['name']} ({c['path']}) step {c.get('step')}, epoch {c.get('epoch')}, "
               f"iter {c.get('iter')}" + (" [resume would pick this]" if self.selected_by == "resume" else "")]
        out.append(f"{'':22}{'recorded':>24}  {'planned':<24}")
        for key, label in DIFF_ROWS:
            a, b = self.recorded.get(key), self.planned.get(key)
            mark = "" if b is None or a is None or a == b else "  <- changed"
            out.append(f"{label:22}{_show(a):>24}  {_show(b, planned=True, key=key):<24}{mark}".rstrip())
        out.append("config diff:" + (" none" if not self.config_diff else ""))
        out += [f"  {line}" for line in self.config_diff]
        out += [f"{label}: {text}" for label, text, _ in self.policy_rows()]
        return out


def _installed_torch_version() -> str | None:
    """``torch.__version__`` of the installed torch, read from its ``version.py`` without importing it."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            try:
                text = (Path(loc) / "version.py").read_text(encoding="utf-8")
            except OSError:
                continue
            m = re.search(r"^__version__\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
            if m:
                return m.group(1)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def resume_diff(run_dir: Path, *, world_size: int | None = None, workers: int | None = None,
                overrides: list[str] | tuple[str, ...] = (), candidate: str | None = None) -> ResumeDiff:
    """Compare a run's checkpoint with a planned resume (torch-free).

    Args:
        run_dir: the run directory.
        world_size: planned world size (ranks); None: the run's recorded launch (what ``pimm
            resume RUN_DIR`` would start).
        workers: planned per-rank loader workers; None: ``data.num_workers`` of the plan's config.
        overrides: ``key=value`` config overrides applied to the run's own ``config.toml``.
        candidate: a candidate name in ``model/`` (default: what a resume would select).

    Raises:
        UsageError: not a run directory; bad world size or workers; unknown candidate.
        ConfigError: the run's config.toml is missing or invalid, or an override is.
        CheckpointError: no complete checkpoint to resume from (exit code 1).
    """
    from ..config import load_config
    from ..run.topology import ROWS, config_diff, plan_resume

    run_dir = check_run_dir(run_dir)
    if world_size is None:
        world_size = recorded_world_size(recorded_launch(run_dir))
    if world_size < 1:
        raise UsageError(f"world size must be at least 1 (got {world_size})")
    if workers is not None and workers < 0:
        raise UsageError(f"per-rank workers must be 0 or more (got {workers})")
    cfg_path = run_dir / CONFIG
    if not cfg_path.is_file():
        raise ConfigError(f"{run_dir} has no config.toml, so there is no plan to compare with; "
                          "pass a run directory written by pimm launch")
    ovr = list(overrides)
    if workers is not None:
        ovr.append(f"data.num_workers={workers}")
    cfg = load_config(cfg_path, ovr)
    saved, _ = read_saved_config(cfg_path)
    chosen, cands = select_resume(run_dir / MODEL)
    if candidate is not None:
        found = [c for c in cands if c.name == candidate or c.path == str(candidate)]
        if not found:
            names = ", ".join(c.name for c in cands) or "none"
            raise UsageError(f"no checkpoint named {candidate!r} in {run_dir / MODEL} (candidates: {names})")
        cand, selected_by = found[0], ("resume" if chosen is not None and found[0].path == chosen.path else "name")
    else:
        if chosen is None:
            found_lines = "; ".join(explain_candidates(cands, None)) or "nothing"
            raise CheckpointError(f"no complete checkpoint in {run_dir / MODEL} (found: {found_lines}); "
                                  "a launch would start fresh")
        cand, selected_by = chosen, "resume"
    manifest = cand.manifest or {}
    prov = read_provenance(run_dir) or {}
    notes: list[str] = []
    recorded: dict[str, Any] = {}
    for key, _label in DIFF_ROWS:
        v = manifest.get(key)
        if v is None and prov.get(key) is not None:
            v = prov.get(key)
            notes.append(f"{key} taken from provenance.json (the manifest does not record it)")
        recorded[key] = v
    if recorded["strategy"] is None and cand.manifest is not None and cand.resumable:
        recorded["strategy"] = "ddp"
        notes.append("strategy: the manifest does not record it (written before pimm recorded strategies); "
                     "taken as ddp")
    if not cand.complete:
        notes.append(f"{cand.name} is incomplete ({cand.reason}); a resume would refuse it")
    if cand.manifest is None:
        notes.append(f"{cand.name} has no readable manifest: recorded values are unknown")
    planned = {"world_size": world_size, "strategy": cfg.train.strategy, "workers_per_rank": cfg.data.num_workers,
               "batch_size": cfg.data.batch_size, "grad_accum": cfg.train.grad_accum,
               "code_version": current_code_version(), "torch_version": _installed_torch_version(),
               "data_fingerprint": None, "data_length": None}
    if recorded.get("data_fingerprint") is not None or recorded.get("data_length") is not None:
        notes.append("the planned data length and fingerprint are computed when the launch loads the data; if "
                     f"either differs from the recorded one, the policy is: {ROWS['data']} (--dry-run loads "
                     "the data and says which row applies)")
    plan = None
    if cand.resumable:
        plan = plan_resume(manifest, world_size=world_size, strategy=cfg.train.strategy,
                           workers_per_rank=cfg.data.num_workers,
                           strict=cfg.resume_strict_state, grad_accum=cfg.train.grad_accum,
                           batch_size=cfg.data.batch_size, legacy=cand.format == "legacy",
                           order=cfg.data.order, global_batch=cfg.train.global_batch, tp=cfg.parallel.tp).to_json()
        planned["grad_accum"] = plan["topology"]["grad_accum"]  # (derived under the global data order)
    diff = config_diff(saved or {}, cfg.to_dict())
    cj = cand.to_json()
    return ResumeDiff(str(run_dir), cj, selected_by, recorded, planned, diff, plan, notes)
