"""Injecting faults into a local cluster: real signals, cgroup CPU quotas and nftables rules.

* ``kill``: ``kill -9`` of a learner, a syncer shard, the embedded Redis (which restarts from
  its append-only file) or the embedded object-store server (``blobs``: SeaweedFS, which
  restarts on its data directory, same port and credentials); the runner restarts the target
  after the fault's down time.
* ``wipe``: the embedded Redis is killed and its data deleted; after the down time it is
  rebuilt from the object store (:mod:`ddiloco.store.wipe`) and serves again on its port.
* ``pause``: SIGSTOP, then SIGCONT (a straggler, or Redis or the object store unavailable).
* ``slow``: a CFS bandwidth limit on the worker's cgroup (``cpu.cfs_quota_us`` =
  period / factor of one core; learners run pinned to one core), i.e. hardware ``factor`` times
  slower. Re-applied to a restarted process while it lasts.
* CPU isolation (optional): every learner limited to its share of the machine's cores, so on a
  machine with fewer cores than learners a surviving learner does not speed up on the cores a
  failed one left idle (which separate hardware would not do).
* ``partition``: nftables rules on the loopback that drop the worker's packets to and from the
  syncer shards' ports or Redis's port: its established connections by their local ports, and
  new ones by the socket's group id (each worker runs under its own gid).

Slow and partition need root, the cgroup ``cpu`` controller and ``nft``; without them
:class:`Injector` raises :class:`ChaosError` saying what is missing, before the run starts.
Everything created carries the run id in its name and is removed by :meth:`Injector.close`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from ddiloco.chaos.script import FaultAction, FaultKind
from ddiloco.pipeline.errors import DDilocoError
from ddiloco.pipeline.waiting import poll_until
from ddiloco.store.base import ParameterStore
from ddiloco.store.wipe import Wipe
from ddiloco.workers.run.launch import LocalCluster

log = logging.getLogger(__name__)

#: group ids given to workers when partitions are used (one per worker name)
GID_BASE = 61000
_CG_V1 = Path("/sys/fs/cgroup/cpu")
_CG_V2 = Path("/sys/fs/cgroup")


class ChaosError(DDilocoError):
    """A fault cannot be injected here (not root, no nft, no cgroup cpu controller, ...)."""


#: Why a script's ``blobs`` faults cannot run: scripts carry no configuration, so say which.
BLOBS_NEED_EMBEDDED = ("blobs faults need store.blobs = 'embedded-s3' (--set "
                       "store.blobs=embedded-s3): the object-store server the chaos runner "
                       "starts, and so can kill and restart")


def check_blobs_faults(actions: list[FaultAction], blobs: object | None) -> None:
    """Refuse faults on ``blobs`` when the run has no embedded object-store server.

    Raises:
        ChaosError: an action targets ``blobs`` and ``blobs`` is None (names the setting).
    """
    hit = [a.id for a in actions if a.target == "blobs"]
    if hit and blobs is None:
        raise ChaosError(f"{hit[0]}: {BLOBS_NEED_EMBEDDED}")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)[:60]


class CpuLimiter:
    """Per-worker cgroups with a CPU bandwidth limit (cgroup v1 ``cpu`` or v2 ``cpu.max``)."""

    PERIOD_US = 100_000

    def __init__(self, run_id: str) -> None:
        self.root: Path
        if (_CG_V1 / "cpu.cfs_quota_us").exists():
            self.root, self.v2 = _CG_V1, False
        elif (_CG_V2 / "cgroup.controllers").exists() and "cpu" in (
                _CG_V2 / "cgroup.controllers").read_text().split():
            self.root, self.v2 = _CG_V2, True
        else:
            raise ChaosError("slow faults need the cgroup cpu controller "
                             "(/sys/fs/cgroup/cpu or cgroup v2 with cpu enabled)")
        if os.geteuid() != 0:
            raise ChaosError("slow faults need root (they write cgroup CPU quotas)")
        self.prefix = f"ddiloco-{_safe(run_id)}"
        self.groups: dict[str, Path] = {}

    def limit(self, worker: str, pid: int, factor: float) -> None:
        """Run ``pid`` at 1/``factor`` of one core."""
        cg = self.groups.get(worker)
        if cg is None:
            cg = self.root / f"{self.prefix}-{_safe(worker)}"
            cg.mkdir(exist_ok=True)
            self.groups[worker] = cg
        quota = max(1000, int(self.PERIOD_US / factor))
        if self.v2:
            (cg / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
        else:
            (cg / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (cg / "cpu.cfs_quota_us").write_text(str(quota))
        (cg / "cgroup.procs").write_text(str(pid))

    def release(self, worker: str, pid: int | None) -> None:
        """Lift the limit: move the process back to the root group."""
        cg = self.groups.pop(worker, None)
        if cg is None:
            return
        if pid is not None:
            try:
                (self.root / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # the process is gone
        self._remove(cg)

    def _remove(self, cg: Path) -> None:
        def removed() -> bool:
            try:
                for pid in (cg / "cgroup.procs").read_text().split():
                    try:
                        (self.root / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass
                cg.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # busy: a process is still leaving it
                return False
            return True

        if not poll_until(removed, timeout_s=1.0, interval_s=0.05):
            log.warning("could not remove cgroup %s", cg)

    def close(self) -> None:
        """Remove every cgroup of this run (also ones left by a crashed runner)."""
        for worker in list(self.groups):
            self.release(worker, None)
        for cg in self.root.glob(f"{self.prefix}-*"):
            self._remove(cg)


class Firewall:
    """An nftables table of this run that drops a worker's loopback traffic to some ports."""

    def __init__(self, run_id: str) -> None:
        if os.geteuid() != 0:
            raise ChaosError("partition faults need root (they add nftables rules)")
        if shutil.which("nft") is None:
            raise ChaosError("partition faults need nft (nftables); install it, e.g. "
                             "apt-get install nftables")
        self.table = f"ddiloco_{_safe(run_id)}"
        self.rules: dict[str, list[str]] = {}
        self._nft(f"add table inet {self.table}")
        self._nft(f"add chain inet {self.table} out "
                  "{ type filter hook output priority 0 ; policy accept ; }")

    def _nft(self, cmd: str) -> None:
        res = subprocess.run(["nft", cmd], capture_output=True, text=True)
        if res.returncode != 0:
            raise ChaosError(f"nft {cmd!r} failed: {res.stderr.strip()}")

    def _apply(self) -> None:
        self._nft(f"flush chain inet {self.table} out")
        for rules in self.rules.values():
            for rule in rules:
                self._nft(f"add rule inet {self.table} out {rule}")

    def partition(self, fault_id: str, gid: int, local_ports: set[int],
                  peer_ports: set[int]) -> None:
        """Drop: new connections of group ``gid`` to ``peer_ports``, and both directions of
        its established connections (``local_ports``)."""
        if not peer_ports:
            raise ChaosError(f"{fault_id}: no peer ports to partition from")
        peers = ", ".join(str(p) for p in sorted(peer_ports))
        rules = [f"meta skgid {gid} tcp dport {{ {peers} }} drop"]
        if local_ports:
            lp = ", ".join(str(p) for p in sorted(local_ports))
            rules += [f"tcp sport {{ {lp} }} tcp dport {{ {peers} }} drop",
                      f"tcp dport {{ {lp} }} tcp sport {{ {peers} }} drop"]
        self.rules[fault_id] = rules
        self._apply()

    def heal(self, fault_id: str) -> None:
        """Remove a partition's rules."""
        if self.rules.pop(fault_id, None) is not None:
            self._apply()

    def close(self) -> None:
        """Delete the table (idempotent)."""
        self.rules.clear()
        subprocess.run(["nft", f"delete table inet {self.table}"], capture_output=True)


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def local_ports_to(pid: int, peer_ports: set[int]) -> set[int]:
    """Local TCP ports of ``pid``'s connections to any of ``peer_ports`` on this host."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return set()
    return {c.laddr.port for c in conns if c.raddr and c.raddr.port in peer_ports}


class Injector:
    """Applies :class:`ddiloco.chaos.script.FaultAction` s to a :class:`LocalCluster`.

    Args:
        cluster: the workers.
        redis: the embedded Redis (``crash``/``restart``/``pid``), or None with an external one
            (then Redis faults raise :class:`ChaosError`).
        store: the run's store (shard endpoints for partitions).
        actions: the faults to come: checked up front so a run fails before it starts.
        wan: emulated regions (:class:`ddiloco.chaos.wan.regions.Regions`) the workers run in,
            or None.
            With regions, partition and congest faults act on region pairs: the target's region
            and each region of its peer (the syncer shards' or Redis's) are cut apart, or their
            links filled with bulk traffic, both ways; every worker in those regions feels it.
        region_of: with ``wan``: worker name (and ``"redis"``) to region.
        blobs: the embedded object-store server
            (:class:`ddiloco.store.embedded_s3.EmbeddedS3`: ``crash``/``restart``/``pid``) of a
            run with ``store.blobs = "embedded-s3"``, or None (then ``blobs`` faults raise
            :class:`ChaosError`). A killed server restarts in the background (SeaweedFS takes
            seconds to elect its master again), so the fault loop keeps its times.

    Raises:
        ChaosError: a fault in ``actions`` cannot be injected on this machine.
    """

    def __init__(self, cluster: LocalCluster, redis: Any, store: ParameterStore,
                 actions: list[FaultAction], redis_port: int | None,
                 learner_cores: float | None = None, wan: Any = None,
                 region_of: dict[str, str] | None = None, blobs: Any = None) -> None:
        check_blobs_faults(actions, blobs)
        self.blobs = blobs
        self._blobs_restart: threading.Thread | None = None
        self._blobs_error: BaseException | None = None
        self.cluster = cluster
        self.wan = wan
        self.region_of = dict(region_of or {})
        #: congest fault id -> its flood processes
        self.floods: dict[str, list[Any]] = {}
        #: partition fault id -> the region pairs it cut
        self.cut: dict[str, list[tuple[str, str]]] = {}
        self.redis = redis
        self.store = store
        self.redis_port = redis_port
        kinds = {a.kind for a in actions}
        self.cpu = (CpuLimiter(cluster.run_id)
                    if FaultKind.SLOW in kinds or learner_cores is not None else None)
        #: each learner's own CPU limit as a slowdown factor of one core (1 / its cores), so a
        #: learner does not speed up on cores that a failed one left idle
        self.base: dict[str, float] = {}
        if learner_cores is not None:
            if learner_cores <= 0:
                raise ChaosError(f"learner_cores must be > 0, got {learner_cores}")
            self.base = {n: 1.0 / learner_cores for n in cluster.names("learner")}
        self.firewall = (Firewall(cluster.run_id)
                         if FaultKind.PARTITION in kinds and wan is None else None)
        for a in actions:
            if a.kind is FaultKind.CONGEST and wan is None:
                raise ChaosError(f"{a.id}: congest faults need emulated regions (--regions)")
            if a.kind in (FaultKind.CONGEST, FaultKind.PARTITION) and wan is not None:
                self.region_pairs(a)
        if any(a.target == "redis" for a in actions) and redis is None:
            raise ChaosError("Redis faults need the embedded Redis (no --redis-url)")
        #: wipe fault id -> its loss and rebuild (store/wipe.py)
        self.wipes: dict[str, Wipe] = {}
        if FaultKind.WIPE in kinds:
            self._check_wipe(redis, store)
        #: persistent slowdowns to re-apply when the worker restarts
        self.slowed: dict[str, float] = {}

    def assign_gids(self) -> None:
        """Give each worker its own group id (before the workers start)."""
        if self.firewall is None:
            return
        for i, name in enumerate(sorted(self.cluster.workers)):
            self.cluster.workers[name].gid = GID_BASE + i

    # ------------------------------------------------------------------ apply / heal
    def inject(self, a: FaultAction) -> None:
        """Start fault ``a``."""
        if a.target == "blobs":
            self._blobs_ready()
            if a.kind is FaultKind.KILL:
                self.blobs.crash()
            elif a.kind is FaultKind.PAUSE:
                self._signal_blobs(signal.SIGSTOP)
            return
        if a.target == "redis":
            if a.kind is FaultKind.WIPE:
                self.wipes[a.id] = Wipe(self.redis, self.cluster.run_id, self._blob_location)
                self.wipes[a.id].lose()
            elif a.kind is FaultKind.KILL:
                self.redis.crash()
            elif a.kind is FaultKind.PAUSE:
                os.kill(self.redis.pid, signal.SIGSTOP)
            return
        if a.kind is FaultKind.KILL:
            self.cluster.kill(a.target)
        elif a.kind is FaultKind.PAUSE:
            self.cluster.signal(a.target, signal.SIGSTOP)
        elif a.kind is FaultKind.SLOW:
            assert a.factor is not None
            self.slowed[a.target] = a.factor
            self._limit(a.target)
        elif a.kind is FaultKind.PARTITION and self.wan is not None:
            self.cut[a.id] = self.region_pairs(a)
            for pair in self.cut[a.id]:
                self.wan.partition(*pair)
        elif a.kind is FaultKind.CONGEST:
            self.floods[a.id] = [p for pair in self.region_pairs(a)
                                 for p in self.wan.congest(*pair)]
        elif a.kind is FaultKind.PARTITION:
            assert self.firewall is not None
            w = self.cluster.workers[a.target]
            peers = self._peer_ports(a.peer or "syncers")
            local = local_ports_to(w.pid, peers) if w.pid is not None else set()
            self.firewall.partition(a.id, w.gid if w.gid is not None else -1, local, peers)

    def heal(self, a: FaultAction) -> None:
        """End fault ``a``: restart a killed target, resume a paused one, lift limits."""
        if a.target == "blobs":
            if a.kind is FaultKind.KILL:
                self._restart_blobs()
            elif a.kind is FaultKind.PAUSE:
                self._signal_blobs(signal.SIGCONT)
            return
        if a.target == "redis":
            if a.kind is FaultKind.WIPE:
                check = self.wipes[a.id].restore()
                log.warning("%s: Redis rebuilt from the object store in %.2f s (down %.1f s); "
                            "heads %s, lost %s", a.id, check.rebuild_s, check.down_s,
                            check.after, check.lost or "nothing")
                self.store.add_event("rebuilt", {"id": a.id, **check.to_json()})
            elif a.kind is FaultKind.KILL:
                self.redis.restart()
            elif a.kind is FaultKind.PAUSE:
                os.kill(self.redis.pid, signal.SIGCONT)
            return
        if a.kind is FaultKind.KILL:
            self.restart(a.target)
        elif a.kind is FaultKind.PAUSE:
            self.cluster.signal(a.target, signal.SIGCONT)
        elif a.kind is FaultKind.SLOW:
            self.slowed.pop(a.target, None)
            self._limit(a.target)
        elif a.kind is FaultKind.PARTITION and self.wan is not None:
            self._heal_cut(a.id)
        elif a.kind is FaultKind.CONGEST:
            self.wan.uncongest(self.floods.pop(a.id, []))
        elif a.kind is FaultKind.PARTITION:
            assert self.firewall is not None
            self.firewall.heal(a.id)

    def _check_wipe(self, redis: Any, store: ParameterStore) -> None:
        """Refuse a ``wipe`` fault that cannot come back: it needs the single embedded Redis
        (not a Sentinel group: a replica would keep the data) and blobs in an object store,
        where the rebuild reads the run from."""
        if redis is None or not hasattr(redis, "lose_data"):
            raise ChaosError("wipe faults need the single embedded Redis of a local run "
                             "(not --redis-url, not run.redis_ha)")
        location = str(getattr(store, "blob_location", "redis"))
        if location == "redis":
            raise ChaosError("wipe faults need blobs in an object store, the rebuild's "
                             "source (--set store.blobs=embedded-s3 or file:///dir)")
        self._blob_location = location

    def _signal_blobs(self, sig: signal.Signals) -> None:
        pid = self.blobs.pid
        if pid is None:
            return  # killed and not restarted: nothing to stop or resume
        try:
            # The server runs in its own session: its group holds every process it forked.
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    def _restart_blobs(self) -> None:
        def run() -> None:
            try:
                self.blobs.restart()
            except BaseException as exc:  # re-raised by _blobs_ready in the loop's thread
                self._blobs_error = exc

        self._blobs_ready()
        self._blobs_restart = threading.Thread(target=run, name="blobs-restart", daemon=True)
        self._blobs_restart.start()

    def _blobs_ready(self) -> None:
        """Wait for a background restart of the object-store server to finish.

        Raises:
            StoreUnavailable: the server did not come back (its log's tail in the message).
        """
        if self._blobs_restart is not None:
            self._blobs_restart.join()
            self._blobs_restart = None
        if self._blobs_error is not None:
            exc, self._blobs_error = self._blobs_error, None
            raise exc

    def _heal_cut(self, fault_id: str) -> None:
        pairs = self.cut.pop(fault_id, [])
        still = {p for others in self.cut.values() for p in others}
        for pair in pairs:
            if pair not in still:  # an overlapping partition of the same pair keeps it cut
                self.wan.heal(*pair)

    def region_pairs(self, a: FaultAction) -> list[tuple[str, str]]:
        """The region pairs a partition or congest fault acts on (with emulated regions).

        Raises:
            ChaosError: the target or a peer is in no region, or shares the target's region
                (a region cannot be cut from itself).
        """
        peers = self.cluster.names("shard") if a.peer == "syncers" else ["redis"]
        where = self.region_of.get(a.target)
        if where is None:
            raise ChaosError(f"{a.id}: {a.target} is in no region of the topology")
        pairs = []
        for peer in peers:
            there = self.region_of.get(peer)
            if there is None:
                raise ChaosError(f"{a.id}: {peer} is in no region of the topology")
            if there == where:
                raise ChaosError(f"{a.id}: {a.target} shares region {where!r} with {peer}; "
                                 "a region cannot be cut from itself")
            pairs.append((where, there))
        return sorted(set(pairs))
    def _limit(self, name: str) -> None:
        """Apply the worker's CPU limit: its base share times any slowdown in force."""
        if self.cpu is None:
            return
        w = self.cluster.workers[name]
        factor = self.base.get(name, 1.0) * self.slowed.get(name, 1.0)
        if w.pid is None or not w.alive:
            return
        if factor == 1.0:
            self.cpu.release(name, w.pid)
        else:
            self.cpu.limit(name, w.pid, factor)

    def limit_all(self) -> None:
        """Apply every worker's limit (after the cluster started)."""
        for name in {*self.base, *self.slowed}:
            self._limit(name)

    def restart(self, name: str) -> None:
        """Start a worker again, with its CPU limit and any slowdown still in force."""
        self.cluster.start(name)
        self._limit(name)

    def _peer_ports(self, peer: str) -> set[int]:
        if peer == "redis":
            if self.redis_port is None:
                raise ChaosError("partition from redis needs the Redis port")
            return {self.redis_port}
        ports: set[int] = set()
        for e in self.store.shards().values():
            for key in ("pull", "pub"):
                if key in e:
                    ports.add(_port(e[key]))
        return ports

    def resume_all(self) -> None:
        """End of a run: resume paused processes and lift slowdowns and partitions."""
        for w in self.cluster.workers.values():
            if w.alive and w.pid is not None:
                try:
                    os.kill(w.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        if self.redis is not None and self.redis.pid is not None:
            try:
                os.kill(self.redis.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if self.blobs is not None:
            self._blobs_ready()
            if self.blobs.pid is None:
                # Killed for good by the script: the drains and the audit need the blobs.
                self.blobs.restart()
            else:
                self._signal_blobs(signal.SIGCONT)
        if self.firewall is not None:
            for fid in list(self.firewall.rules):
                self.firewall.heal(fid)
        for fid in list(self.cut):
            self._heal_cut(fid)
        for fid in list(self.floods):
            self.wan.uncongest(self.floods.pop(fid))
        slowed = list(self.slowed)
        self.slowed.clear()
        for name in slowed:
            self._limit(name)

    def close(self) -> None:
        """Remove every rule and cgroup this run created, and wait for a restarting
        object-store server."""
        if self._blobs_restart is not None:
            self._blobs_restart.join()
            self._blobs_restart = None
        if self.firewall is not None:
            self.firewall.close()
        if self.cpu is not None:
            self.cpu.close()
