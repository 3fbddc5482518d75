"""A run directory polled as a whole: one immutable :class:`RunSnapshot` per poll, for a worker thread (torch-free).

:class:`RunReader` reads ``status.json`` (:mod:`.status`), ``metrics.jsonl`` (:mod:`.metrics`),
``train.log``, ``config.toml``, ``provenance.json`` and the checkpoint candidates, each
only when it changed, and says in one list what is odd about the run.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.records.generation import GenerationChanged
from ..checkpoint.select.selection import Candidate, select_resume
from ..config import read_saved_config
from ..run.layout import CONFIG, LOG, METRICS, MODEL, PROVENANCE, run_markers
from ..run.log import LogTail
from ..run.provenance import read_provenance
from ..run.ranks import RankBeat, describe_lag, lagging_ranks, ranks_alive, read_rank_beats, stragglers
from ..run.stacks import read_stack_frame
from ..run.values import json_int
from .candidates import candidate_identity
from .metrics import MetricsTail
from .series import NonFinite
from .status import LIVE_STATES, StatusView, read_status, stale_after_for
from ..run.memory_index import MemoryTier, read_memory_tier
from .tiers import MemoryStep, RemoteTier, TierAge, disk_tier, memory_steps, memory_tier, recovery_text


@dataclass(frozen=True)
class RunSnapshot:
    """Everything a watcher shows, read at one moment (safe to hand across threads).

    ``metrics_version``/``log_version``/``candidates_key`` change only when the
    underlying data did, so a UI redraws only what changed.
    """

    run_dir: Path
    time: float
    status: StatusView
    markers: tuple[str, ...]
    problems: tuple[str, ...]
    step: int | None
    total_steps: int | None
    epoch: int | None
    epochs: int | None
    steps_per_s: float | None
    samples_per_s: float | None
    eta_s: float | None
    last_train: dict[str, Any] | None
    last_val: dict[str, Any] | None
    best_val: dict[str, Any] | None
    metric: str
    mode: str
    loss: tuple[tuple[float, ...], tuple[float, ...]]
    lr: tuple[tuple[float, ...], tuple[float, ...]]
    metrics_version: int
    metrics_records: int
    metrics_sampled: bool
    log_lines: tuple[str, ...]
    log_version: int
    candidates: tuple[Candidate, ...]
    chosen: str | None
    candidates_key: tuple[Any, ...]
    config: dict[str, Any] | None
    provenance: dict[str, Any] | None
    #: metrics that were NaN or +-Inf somewhere in metrics.jsonl (copies; key order of first sight)
    nonfinite: tuple[NonFinite, ...] = ()
    #: :func:`candidate_identity` of each of ``candidates`` (same order)
    candidate_ids: tuple[tuple[Any, ...], ...] = ()
    #: every rank's heartbeat (``ranks/<rank>.json``), rank order
    ranks: tuple[RankBeat, ...] = ()
    #: the ranks the others wait for (:func:`~pimm_core.run.ranks.lagging_ranks`), only while the run is live
    lagging: tuple[int, ...] = ()
    #: while the part of a large metrics.jsonl before its tail is still being scanned for evaluations and
    #: non-finite values (a slice per poll, after the first paint): the fraction done; else None
    metrics_history: float | None = None
    #: the ranks whose steps take 1.5x the median rank's (:func:`~pimm_core.run.ranks.stragglers`), while live
    stragglers: tuple[int, ...] = ()
    #: ``(rank, the frame it waits in)`` from ``ranks/<rank>.stack`` written at a hang, for ranks that have
    #: not moved since (:mod:`pimm_core.run.stacks`)
    frames: tuple[tuple[int, str], ...] = ()
    #: the newest checkpoint of each tier: memory, disk, remote (:mod:`.tiers`)
    tiers: tuple[TierAge, ...] = ()
    #: the memory tier's steps, newest first (``memory/<rank>.json``)
    memory: tuple[MemoryStep, ...] = ()
    #: ``recovered from memory at step 120 (restart 1)``: status.json's latest recovery, or None
    recovery: str | None = None
    #: saves replaced the checkpoints during every read of this poll (a run saving in quick succession):
    #: ``candidates`` and ``chosen`` are the previous poll's, none at the first; the next poll reads again
    checkpoints_changed: bool = False

    def frame_of(self, rank: int) -> str | None:
        return next((f for r, f in self.frames if r == rank), None)

    def nonfinite_of(self, key: str) -> NonFinite | None:
        """The :class:`NonFinite` record of metric ``key`` (``loss``, ``lr``, ``val/loss``), or None."""
        return next((n for n in self.nonfinite if n.key == key), None)



class RunReader:
    """Reads a run directory incrementally; call :meth:`poll` (from one thread at a time)."""

    def __init__(self, run_dir: Path, *, checkpoint_every_s: float = 2.0, **metrics_kw: Any):
        self.run_dir = Path(run_dir)
        # The first poll reads the tail (and a sample) only: the console's open does not grow with the
        # file; the rest is scanned a slice per later poll (MetricsTail's lazy_history).
        self.metrics = MetricsTail(self.run_dir / METRICS, **{"lazy_history": True, **metrics_kw})
        self.log = LogTail(self.run_dir / LOG)
        self.checkpoint_every_s = checkpoint_every_s
        self._cands: tuple[tuple[Candidate, ...], str | None, tuple[Any, ...]] = ((), None, ())
        self._changed = False  # (the last read of the candidates was overtaken by saves: RunSnapshot.checkpoints_changed)
        self._ids: tuple[tuple[Any, ...], ...] = ()
        self._cands_at = 0.0
        self._model_key: Any = None
        self._config: tuple[Any, dict[str, Any] | None, str | None] = (None, None, None)
        self._prov: tuple[Any, dict[str, Any] | None] = (None, None)
        self._ranks: tuple[float, tuple[RankBeat, ...], tuple[tuple[int, str], ...]] = (float("-inf"), (), ())
        self._memory: tuple[float, MemoryTier, tuple[MemoryStep, ...]] = (float("-inf"), MemoryTier(), ())
        self.remote = RemoteTier(self.run_dir)

    def _mtime_key(self, path: Path) -> Any:
        try:
            st = path.stat()
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    def _read_config(self) -> tuple[dict[str, Any] | None, str | None]:
        key = self._mtime_key(self.run_dir / CONFIG)
        if key != self._config[0]:
            cfg, problem = read_saved_config(self.run_dir / CONFIG)
            self._config = (key, cfg, problem)
        return self._config[1], self._config[2]

    def _read_provenance(self) -> dict[str, Any] | None:
        key = self._mtime_key(self.run_dir / PROVENANCE)
        if key != self._prov[0]:
            self._prov = (key, read_provenance(self.run_dir))
        return self._prov[1]

    def _read_candidates(self, now: float, force: bool) -> tuple[tuple[Candidate, ...], str | None, tuple[Any, ...]]:
        model = self.run_dir / MODEL
        key = self._mtime_key(model)
        if not force and key == self._model_key and now - self._cands_at < self.checkpoint_every_s:
            return self._cands
        self._cands_at = now
        self._changed = False
        # A save that rotates `last` (or replaces a file and then its sidecar) while the
        # candidates are hashed can make an intact checkpoint look corrupt for a moment:
        # read again until model/ did not change during the read (at most 3 times).
        for _ in range(3):
            try:
                chosen, cands = select_resume(model)
            except GenerationChanged:
                self._changed = True
                return self._cands  # saves kept replacing `last`: what was shown stays, read again next poll
            except OSError:
                chosen, cands = None, []
            after = self._mtime_key(model)
            if after == key:
                break
            key = after
        self._model_key = key
        ids = tuple(candidate_identity(c) for c in cands)
        ckey = tuple((c.name, c.complete, c.step, c.size, c.reason, c.created, i) for c, i in zip(cands, ids))
        self._cands = (tuple(cands), chosen.name if chosen else None, ckey)
        self._ids = ids
        return self._cands

    def _read_ranks(self, now: float, world_size: int | None) -> tuple[RankBeat, ...]:
        """The ranks' heartbeats, read at most once a second (they are written about as often)."""
        if now - self._ranks[0] >= 1.0 or now < self._ranks[0]:
            beats = tuple(read_rank_beats(self.run_dir, world_size))
            frames = tuple((b.rank, f) for b in beats
                           if (f := read_stack_frame(self.run_dir, b.rank, since=b.progress)) is not None)
            self._ranks = (now, beats, frames)
        return self._ranks[1]

    def _read_tiers(self, now: float, config: dict[str, Any] | None,
                    cands: tuple[Candidate, ...]) -> tuple[tuple[TierAge, ...], tuple[MemoryStep, ...]]:
        """The newest checkpoint of each tier; the memory index is read at most once a second
        (one small file per rank), the remote store listed at most every 30 s."""
        if now - self._memory[0] >= 1.0 or now < self._memory[0]:
            tier = read_memory_tier(self.run_dir)
            self._memory = (now, tier, tuple(memory_steps(tier.ranks)))
        _, tier, steps = self._memory
        every = json_int(((config or {}).get("checkpoint") or {}).get("memory_every_steps"))
        tiers = (memory_tier(tier, now, on=bool(every)), disk_tier(cands, now),
                 self.remote.poll(now, config))
        return tiers, steps

    def poll(self, *, now: float | None = None, force_checkpoints: bool = False) -> RunSnapshot:
        """Read what changed and return a snapshot (never raises for damaged files)."""
        now = time.time() if now is None else now
        m = self.metrics
        m.poll()
        self.log.poll()
        interval = m.log_interval()
        status = read_status(self.run_dir, now=now, stale_after=stale_after_for(interval))
        config, config_problem = self._read_config()
        prov = self._read_provenance()
        cands, chosen, ckey = self._read_candidates(now, force_checkpoints)
        markers = tuple(run_markers(self.run_dir))

        problems: list[str] = []
        if not self.run_dir.is_dir():
            problems.append("the run directory does not exist (yet)")
        elif not markers:
            problems.append("empty run directory: no config.toml, status.json, metrics.jsonl or model/ yet")
        if status.problem and markers:
            problems.append(status.problem)
        if status.note:
            problems.append(status.note)
        if config_problem:
            problems.append(config_problem)
        elif config is None and markers:
            problems.append("no config.toml (half-created run?)")
        if not m.exists and markers:
            problems.append("no metrics.jsonl yet")
        if m.bad_lines:
            problems.append(f"metrics.jsonl: {m.bad_lines} damaged line(s) skipped")
        if m.pending and not status.live:
            problems.append(f"metrics.jsonl ends with an unfinished line ({m.pending} bytes, ignored)")
        if status.state == "failed" and status.record.error:
            problems.append(f"run failed: {status.record.error}")
        ranks = self._read_ranks(now, status.record.world_size)
        # (a hang silences status.json; the ranks' own files still say their processes live)
        watching = status.live or (status.state in LIVE_STATES and ranks_alive(list(ranks), now))
        lagging = lagging_ranks(list(ranks), now) if watching and len(ranks) > 1 else []
        frames = dict(self._ranks[2])
        problems.extend(describe_lag(b, now) + (f", waiting in {frames[b.rank]}" if b.rank in frames else "")
                        for b in lagging)
        slow = stragglers(list(ranks)) if watching else []
        nonfinite = tuple(dataclasses.replace(n) for n in m.nonfinite.values())
        if nonfinite:
            problems.append("; ".join(n.note() for n in nonfinite))
        if self._changed and not cands:
            problems.append("checkpoints: saves replaced them while they were read; read again at the next refresh")
        bad_manifests = [c.name for c in cands if c.manifest_problem]
        if bad_manifests:
            problems.append(f"damaged manifest: {', '.join(bad_manifests)}")

        st = status.record
        last = m.last_train or {}
        step = st.step
        last_step = json_int(last.get("step"))
        if step is None or (last_step is not None and status.live and last_step > step):
            step = last_step if last_step is not None else step
        epoch = st.epoch
        if epoch is None:
            epoch = json_int(last.get("epoch"))
        total = st.total_steps
        epochs = st.epochs
        if epochs is None and config:
            epochs = json_int((config.get("train") or {}).get("epochs"))
        steps_per_s, samples_per_s = m.rate()
        wall = m.wall_steps_per_s()  # the ETA counts evaluation and saving too
        eta = None
        if status.live and wall and total is not None and step is not None:
            eta = max(0.0, (total - step) / wall)
        ev = (config or {}).get("eval") or {}
        metric = ev.get("metric") if isinstance(ev.get("metric"), str) else "val/acc"
        mode = ev.get("mode") if ev.get("mode") in ("max", "min") else "max"
        tiers, memory = self._read_tiers(now, config, cands)
        lx, ly = m.loss.points()
        rx, ry = m.lr.points()
        return RunSnapshot(
            run_dir=self.run_dir, time=now, status=status, markers=markers, problems=tuple(problems),
            step=step, total_steps=total, epoch=epoch, epochs=epochs, steps_per_s=steps_per_s,
            samples_per_s=samples_per_s,
            eta_s=eta, last_train=m.last_train, last_val=m.last_val, best_val=m.best_val(metric, mode),
            metric=metric, mode=mode, loss=(tuple(lx), tuple(ly)), lr=(tuple(rx), tuple(ry)),
            metrics_version=m.version, metrics_records=m.records, metrics_sampled=m.sampled,
            log_lines=tuple(self.log.lines), log_version=self.log.version,
            candidates=cands, chosen=chosen, candidates_key=ckey, config=config, provenance=prov,
            nonfinite=nonfinite, candidate_ids=self._ids, ranks=ranks, lagging=tuple(b.rank for b in lagging),
            metrics_history=m.history_pending,
            stragglers=tuple(b.rank for b, _ in slow), frames=self._ranks[2],
            tiers=tiers, memory=memory, recovery=recovery_text(st.recovery), checkpoints_changed=self._changed,
        )

