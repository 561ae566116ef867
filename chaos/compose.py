"""Chaos on a compose deployment: the faults of a script, applied to containers through the
Docker Engine API (the ``docker`` SDK), with the same accounting and audit as local runs.

``ddiloco chaos run SCRIPT --compose PROJECT`` attaches to a running ``docker compose`` project
(compose.yaml): it reads the run id from the containers, talks to the project's Redis at its
container address, waits until every learner trains, then plays the script:

* ``kill``: ``docker kill`` (SIGKILL) of the service's container; the fault's end starts it
  again (``docker start``): a learner rejoins from the store and its checkpoint, a shard takes
  its lease back, Redis replays its append-only file, the object store (target ``blobs``, the
  service ``blobs``) serves its volume again;
* ``pause``: ``docker pause`` / ``unpause`` (the cgroup freezer: a straggler, or Redis or the
  object store hung);
* ``slow``: a CFS quota of ``1 / factor`` CPU on the container (``docker update --cpus``), lifted
  at the end;
* ``partition``: iptables rules inside the target's own network namespace (``docker exec``;
  compose gives every worker ``NET_ADMIN``) dropping its packets to and from the shards' or
  Redis's container addresses, removed at the end.

``congest`` needs the emulated regions of ``--regions`` and is refused here. Only DiLoCo runs on
compose (the data-parallel baseline is a local comparison). After the script's window the runner
heals every fault, waits for the run to end (the ``finish`` service exits), starts Redis again if
``finish`` shut it down, and accounts for the run from the store: ``OUT/chaos.json`` and
``OUT/chaos.png``, as :func:`ddiloco.chaos.runner.run_chaos` writes them.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from ddiloco.chaos.faults import ChaosError
from ddiloco.chaos.script import FaultAction, FaultKind, describe, expand, load_script
from ddiloco.pipeline.waiting import poll_until

log = logging.getLogger(__name__)

__all__ = ["SERVICES", "ComposeDeployment", "ComposeInjector", "partition_rules",
           "run_compose_chaos", "service_of"]

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
_CPU_PERIOD_US = 100_000
#: Script targets that are servers, not workers -> the compose.yaml service that runs them
#: (workers are services of their own name).
SERVICES = {"redis": "redis", "blobs": "blobs"}


def service_of(target: str) -> str:
    """The compose service of a script target (pure): ``blobs`` -> the object-store service
    ``blobs``, ``redis`` -> ``redis``, a worker (``learner-0``, ``shard-1``) -> itself."""
    return SERVICES.get(target, target)


def partition_rules(fault_id: str, peers: list[str]) -> list[list[str]]:
    """The iptables rule specs (without ``-I``/``-D``) that cut a container from ``peers``
    (IPv4 addresses) both ways, tagged with the fault id (pure)."""
    tag = ["-m", "comment", "--comment", f"ddiloco-{fault_id}"[:250]]
    rules: list[list[str]] = []
    for ip in peers:
        rules.append(["OUTPUT", "-d", ip, *tag, "-j", "DROP"])
        rules.append(["INPUT", "-s", ip, *tag, "-j", "DROP"])
    return rules


def cpu_quota_us(factor: float) -> int:
    """CFS quota per :data:`_CPU_PERIOD_US` period for a container ``factor`` times slower
    than one core (pure).

    Raises:
        ChaosError: ``factor`` is not > 1.
    """
    if not factor > 1.0:
        raise ChaosError(f"a slow fault's factor must be > 1, got {factor}")
    return max(1000, int(_CPU_PERIOD_US / factor))


class ComposeDeployment:
    """The containers of one compose project, by service name.

    Raises:
        ChaosError: the ``docker`` package is missing, no engine answers, or the project has
            no containers.
    """

    def __init__(self, project: str, client: Any = None) -> None:
        if client is None:
            try:
                # By name: the repository's docker/ folder (scripts) shadows the SDK for mypy.
                docker: Any = importlib.import_module("docker")
            except ImportError as exc:
                raise ChaosError("chaos on compose needs the docker SDK: "
                                 "pip install 'ddiloco[compose]'") from exc
            try:
                client = docker.from_env()
                client.ping()
            except Exception as exc:
                raise ChaosError(f"no Docker engine answers: {exc}") from None
        self.client = client
        self.project = project
        if not self.containers():
            raise ChaosError(f"compose project {project!r} has no containers "
                             "(docker compose -p PROJECT up first)")

    def containers(self) -> dict[str, Any]:
        """Service name -> its container (the first replica), stopped ones included."""
        found = self.client.containers.list(all=True,
                                            filters={"label": f"{PROJECT_LABEL}={self.project}"})
        return {c.labels[SERVICE_LABEL]: c for c in sorted(found, key=lambda c: c.name)}

    def container(self, service: str) -> Any:
        """The container of ``service``, refreshed.

        Raises:
            ChaosError: no such service in the project.
        """
        c = self.containers().get(service)
        if c is None:
            raise ChaosError(f"compose project {self.project!r} has no service {service!r}")
        c.reload()
        return c

    def address(self, service: str) -> str:
        """The service's first IPv4 address (on any of its networks).

        Raises:
            ChaosError: the container has no address (it is not running).
        """
        nets = self.container(service).attrs["NetworkSettings"]["Networks"] or {}
        for info in nets.values():
            if info.get("IPAddress"):
                return str(info["IPAddress"])
        raise ChaosError(f"{service} has no address (is it running?)")

    def env(self, service: str) -> dict[str, str]:
        """The container's environment."""
        pairs = self.container(service).attrs["Config"]["Env"] or []
        return dict(p.split("=", 1) for p in pairs if "=" in p)

    def run_id(self) -> str:
        """``DDILOCO_RUN_ID`` of the project's workers.

        Raises:
            ChaosError: no worker names one.
        """
        for service in ("finish", "shard-0", "evaluator", "learner-0"):
            try:
                rid = self.env(service).get("DDILOCO_RUN_ID")
            except ChaosError:
                continue
            if rid:
                return rid
        raise ChaosError(f"no container of {self.project!r} sets DDILOCO_RUN_ID")

    def redis_url(self) -> str:
        """``redis://ADDRESS:6379/0`` of the project's Redis, reachable from the host."""
        return f"redis://{self.address('redis')}:6379/0"

    def restart_counts(self) -> dict[str, int]:
        """Restarts by the engine's restart policy, per service."""
        return {s: int(c.attrs.get("RestartCount", 0)) for s, c in self.containers().items()
                if c.attrs.get("RestartCount")}


class ComposeInjector:
    """Applies :class:`ddiloco.chaos.script.FaultAction` s to a :class:`ComposeDeployment` (the
    interface of :class:`ddiloco.chaos.faults.Injector` that :mod:`ddiloco.chaos.runner` drives).

    Raises:
        ChaosError: a fault in ``actions`` cannot be applied to containers (``congest``).
    """

    def __init__(self, deployment: ComposeDeployment, shards: list[str],
                 actions: list[FaultAction]) -> None:
        self.dep = deployment
        self.shards = shards
        for a in actions:
            if a.kind is FaultKind.CONGEST:
                raise ChaosError(f"{a.id}: congest faults need emulated regions (--regions), "
                                 "not compose")
            if a.kind is FaultKind.PARTITION and a.target == "redis":
                raise ChaosError(f"{a.id}: partition Redis from a worker instead")
            if a.kind is FaultKind.WIPE:
                raise ChaosError(f"{a.id}: wipe faults need the embedded Redis of a local run, "
                                 "not compose")
        self.paused: set[str] = set()
        self.slowed: set[str] = set()
        #: partition fault id -> (target, rule specs)
        self.cut: dict[str, tuple[str, list[list[str]]]] = {}

    def _exec(self, service: str, cmd: list[str]) -> None:
        c = self.dep.container(service)
        if c.status != "running":
            log.info("%s is %s: %s not applied", service, c.status, " ".join(cmd))
            return
        code, output = c.exec_run(cmd)
        if code != 0:
            raise ChaosError(f"{service}: {' '.join(cmd)} failed ({code}): "
                             f"{output.decode(errors='replace').strip()} (compose gives workers "
                             "NET_ADMIN; the image has iptables)")

    def _peers(self, a: FaultAction) -> list[str]:
        names = self.shards if (a.peer or "syncers") == "syncers" else ["redis"]
        return [self.dep.address(n) for n in names]

    def inject(self, a: FaultAction) -> None:
        """Start fault ``a``."""
        c = self.dep.container(service_of(a.target))
        if a.kind is FaultKind.KILL:
            c.kill(signal="SIGKILL")
        elif a.kind is FaultKind.PAUSE:
            c.pause()
            self.paused.add(service_of(a.target))
        elif a.kind is FaultKind.SLOW:
            assert a.factor is not None
            c.update(cpu_period=_CPU_PERIOD_US, cpu_quota=cpu_quota_us(a.factor))
            self.slowed.add(a.target)
        elif a.kind is FaultKind.PARTITION:
            rules = partition_rules(a.id, self._peers(a))
            for rule in rules:
                self._exec(a.target, ["iptables", "-w", "-I", *rule])
            self.cut[a.id] = (a.target, rules)

    def heal(self, a: FaultAction) -> None:
        """End fault ``a``: start a killed container, unpause, lift the quota or the rules."""
        c = self.dep.container(service_of(a.target))
        if a.kind is FaultKind.KILL:
            self.restart(a.target)
        elif a.kind is FaultKind.PAUSE:
            if c.status == "paused":
                c.unpause()
            self.paused.discard(service_of(a.target))
        elif a.kind is FaultKind.SLOW:
            self._unslow(a.target)
        elif a.kind is FaultKind.PARTITION:
            self._heal_cut(a.id)

    def _unslow(self, service: str) -> None:
        # A quota of -1 is "no limit" for the engine.
        self.dep.container(service).update(cpu_period=_CPU_PERIOD_US, cpu_quota=-1)
        self.slowed.discard(service)

    def _heal_cut(self, fault_id: str) -> None:
        target, rules = self.cut.pop(fault_id, ("", []))
        for rule in rules:
            try:
                self._exec(target, ["iptables", "-w", "-D", *rule])
            except ChaosError as exc:
                log.warning("heal %s: %s", fault_id, exc)

    def restart(self, name: str) -> None:
        """Start a stopped container again (after a kill); ``name``: a script target."""
        c = self.dep.container(service_of(name))
        if c.status in ("exited", "created", "dead"):
            c.start()

    def resume_all(self) -> None:
        """End of the window: unpause, lift every quota and partition still in force."""
        for name in list(self.paused):
            c = self.dep.container(name)
            if c.status == "paused":
                c.unpause()
            self.paused.discard(name)
        for name in list(self.slowed):
            self._unslow(name)
        for fid in list(self.cut):
            self._heal_cut(fid)

    def close(self) -> None:
        """Nothing outlives the containers (rules live in their own namespaces)."""
        self.resume_all()


def run_compose_chaos(script_path: Path, out: Path, *, project: str = "ddiloco",
                      seed: int | None = None, start_timeout_s: float = 600.0,
                      end_timeout_s: float = 3600.0,
                      deployment: ComposeDeployment | None = None) -> dict[str, Any]:
    """Play ``script_path`` against compose project ``project``; returns the report (also
    ``out/chaos.json`` and ``out/chaos.png``).

    Raises:
        ScriptError: the script is invalid. ChaosError: no engine, no such project, a fault
            that compose cannot take, or a run that did not end in ``end_timeout_s``.
        InvariantViolation: the audit failed (the report is written first).
    """
    from ddiloco.chaos.chaos_report import ModeRun, finish_report, mode_block
    from ddiloco.chaos.fault_loop import (
        FaultWindow,
        Health,
        LiveStats,
        play_window,
        record_recoveries,
        schedule,
        wait_store,
    )
    from ddiloco.store.connect import connect
    from ddiloco.store.redis_store import RedisStore
    from ddiloco.workers.run.manifest import manifest_config, wait_for_manifest

    dep = deployment or ComposeDeployment(project)
    run_id = dep.run_id()
    store = RedisStore(connect(dep.redis_url(), attempts=1, timeout_s=1.0), run_id)
    cfg = manifest_config(wait_for_manifest(store))
    if cfg.run.mode != "diloco":
        raise ChaosError(f"run {run_id!r} is in mode {cfg.run.mode!r}: compose runs DiLoCo")
    script = load_script(script_path)
    actions = expand(script, cfg.run.learners, cfg.run.shards, seed)
    learners = [f"learner-{i}" for i in range(cfg.run.learners)]
    shards = [f"shard-{s}" for s in range(cfg.run.shards)]
    for name in sorted({a.target for a in actions}):
        if name == "blobs" and service_of(name) not in dep.containers():
            raise ChaosError(f"{project}: blobs faults need the project's object-store "
                             f"service {service_of(name)!r} (compose.yaml), which it has not")
        dep.container(service_of(name))  # every target is a service of the project
    injector = ComposeInjector(dep, shards, actions)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "script": {"name": script.name, "seed": script.seed if seed is None else seed,
                   "duration_s": script.duration_s, "path": str(script_path)},
        "target": {"compose": project},
        "actions": [a.to_json() for a in actions],
        "faults_planned": describe(actions),
        "config": cfg.model_dump(mode="json"),
        "modes": {},
    }
    # The window opens once every learner has taken a step (compiled, synced, training), as
    # for local runs: faults during start-up would count as lost work.
    def training() -> bool:
        started = {e["learner"] for _, e in store.events(kinds={"first_step"})}
        return started >= set(learners)

    if not poll_until(training, timeout_s=start_timeout_s, interval_s=0.5):
        started = {e["learner"] for _, e in store.events(kinds={"first_step"})}
        raise ChaosError(f"{project}: {sorted(set(learners) - started)} not training "
                         f"after {start_timeout_s:.0f} s")
    restarts0 = dep.restart_counts()
    t0 = time.time()
    window = FaultWindow("diloco", schedule(actions, script.duration_s), learners, shards,
                         Health(None), LiveStats(t0))
    pending, down = window.pending, window.down
    store.add_event("chaos_start", {"mode": "diloco", "duration_s": script.duration_s,
                                    "target": f"compose:{project}"}, t=t0)

    def progress(now: float, w: FaultWindow) -> None:
        print(f"[chaos {now:5.0f}/{script.duration_s:.0f} s] faults {w.stats.faults}, "
              f"down {sorted(w.down) or '-'}", flush=True)

    try:
        play_window(window, store, injector, None, script.duration_s, report=progress,
                    report_every_s=10.0)
        t_end = time.time()
    finally:
        injector.resume_all()
    for name in sorted(down):
        injector.restart(name)
    wait_store(store, pending)
    record_recoveries(store, t0)
    store.add_event("chaos_end", {"mode": "diloco"}, t=t_end)
    pending.flush(store)
    print(f"window over; waiting for {project}'s run to end (the finish service)", flush=True)
    if not poll_until(lambda: dep.container("finish").status in ("exited", "dead"),
                      timeout_s=end_timeout_s, interval_s=2.0):
        raise ChaosError(f"{project}: the run did not end within {end_timeout_s:.0f} s")
    if dep.container("redis").status != "running":
        dep.container("redis").start()  # finish shut it down; its AOF holds the run
    store = RedisStore(connect(dep.redis_url(), attempts=30, timeout_s=2.0), run_id)
    restarts = {k: v - restarts0.get(k, 0) for k, v in dep.restart_counts().items()
                if v > restarts0.get(k, 0)}
    run = ModeRun("diloco", run_id, t0, t_end, restarts)
    report["modes"]["diloco"] = mode_block(store, run, cfg)
    (out / "chaos.json").write_text(json.dumps(report, indent=2, default=str))
    return finish_report(report, cfg, out)
