"""Process control of a run under supervisord (its launch plan is ops/plan.py): start supervisord on the
plan, set the run up and start the workers in order, watch for failed programs, and stop them in order
(producers, trainer, aggregator, redis) with a report of each program's exit status.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import xmlrpc.client
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.xmlrpc import SupervisorTransport

from rollstream.bus import setup_run, wait_until_ready
from rollstream.config import PipelineConfig
from rollstream.keys import Keys, producer_names
from rollstream.ops.embedded_redis import wait_for_redis
from rollstream.ops.plan import (
    CONF_NAME,
    PRIVATE_UMASK,
    RUN_TMP_DIR,
    WORKER_STOPWAIT_S,
    RunPlan,
    SuperviseError,
    supervisor_socket,
    write_private,
)
from rollstream.ops.run_target import REDIS_URL_FILE, SECRETS_DIR, RunTarget
from rollstream.runtime.procfs import is_running
from rollstream.topology.cluster import refuse_plain_cluster_node
from rollstream.topology.node import sentinel_master
from rollstream.topology.replicated import (
    PRIMARY_DATA_FILE,
    SENTINEL_PASSWORD_FILE,
    data_dir_of,
    wait_failover_ready,
)
from rollstream.topology.replication import is_sentinel_url

# --- talking to a running supervisord ----------------------------------------------------------------


class _OneCallTransport(SupervisorTransport):  # type: ignore[misc]
    """supervisord's unix-socket transport, closing its connection after every call: a proxy is made per
    use and dropped, which would otherwise leave its socket open until garbage collection."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().request(*args, **kwargs)
        finally:
            self.close()


def rpc(run_dir: Path) -> Any:
    """XML-RPC proxy of the run's supervisord (the API supervisorctl uses)."""
    transport = _OneCallTransport(None, None, f"unix://{supervisor_socket(run_dir)}")
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)


def supervisor_up(run_dir: Path) -> bool:
    """True when the run's supervisord answers on its socket."""
    if not supervisor_socket(run_dir).exists():
        return False
    try:
        return bool(rpc(run_dir).supervisor.getState()["statename"] == "RUNNING")
    except (OSError, xmlrpc.client.Error):
        return False


def process_states(run_dir: Path) -> list[dict[str, Any]] | None:
    """supervisord's view of each program (name, statename, pid, exitstatus, description); None when down."""
    if not supervisor_up(run_dir):
        return None
    return list(rpc(run_dir).supervisor.getAllProcessInfo())


def _wait(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SuperviseError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)


def start_supervisord(plan: RunPlan, foreground: bool = False) -> subprocess.Popen[bytes] | None:
    """Start supervisord on the plan's config (daemonized, or as a child with -n when foreground) and wait
    until it answers; the previous supervisord.log is kept as supervisord.log.1."""
    if supervisor_up(plan.run_dir):
        raise SuperviseError(f"a supervisord for {plan.run_dir} is already up: `rollstream stop` it first")
    log = plan.run_dir / "logs" / "supervisord.log"
    if log.exists():
        log.replace(log.with_suffix(".log.1"))
    argv = [sys.executable, "-m", "supervisor.supervisord", "-c", str(plan.conf_path)]
    proc = None
    if foreground:  # supervisord creates its logs before applying its own umask setting: start it private
        proc = subprocess.Popen([*argv, "-n"], umask=PRIVATE_UMASK)
    else:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, umask=PRIVATE_UMASK)
        if done.returncode != 0:
            raise SuperviseError(
                f"supervisord failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
            )
    _wait(lambda: supervisor_up(plan.run_dir), 30, "supervisord to answer")
    return proc


def start_run(plan: RunPlan, cfg: PipelineConfig, redis_timeout_s: float = 60.0) -> None:
    """With supervisord up: wait for Redis, set the run up (streams + groups), start the workers in order."""
    target = RunTarget(cfg=cfg, keys=Keys(cfg.run.name), run_dir=plan.run_dir, redis_url=plan.redis_url)
    if any(p.name == "redis" for p in plan.programs) and not target.uses_acl() and not is_sentinel_url(
        plan.redis_url
    ):
        wait_for_redis(plan.redis_url, redis_timeout_s)  # with ACLs on, wait_until_ready below (as admin)
    r = target.connect()
    try:
        wait_until_ready(r, timeout_s=redis_timeout_s)
        try:
            refuse_plain_cluster_node(r, plan.redis_url)
        except ValueError as e:
            raise SuperviseError(str(e)) from None
        setup_run(r, target.keys, producer_names(cfg.rollout.num_producers))
    finally:
        r.close()
    if cfg.run.redis.replicas and is_sentinel_url(plan.redis_url):  # the workers start failover-ready
        pw = (plan.run_dir / SECRETS_DIR / SENTINEL_PASSWORD_FILE).read_text().strip()
        try:
            wait_failover_ready(plan.redis_url, pw, cfg.run.redis.replicas, redis_timeout_s)
        except RuntimeError as e:
            raise SuperviseError(f"replicated redis: {e}") from None
    server = rpc(plan.run_dir)
    for name in plan.workers:
        server.supervisor.startProcess(name, False)


def wait_for_producers(target: RunTarget, timeout_s: float, poll_s: float = 0.5) -> list[str]:
    """Block until every producer has loaded a version (its engine is up: `producer:<name>:version` set);
    SuperviseError naming each failed program with its last log line as soon as one fails (an engine that
    cannot start exits with a status supervisord does not restart). Returns the producers still not ready
    after `timeout_s` (empty when all are)."""
    names = producer_names(target.cfg.rollout.num_producers)
    r = target.connect()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            failed = failed_programs(target.run_dir)
            if failed:
                raise SuperviseError("; ".join(failed))
            values = r.mget([target.keys.producer_version(n) for n in names])
            waiting = [n for n, v in zip(names, values, strict=True) if v is None]  # type: ignore[arg-type]
            if not waiting or time.monotonic() > deadline:
                return waiting
            time.sleep(poll_s)
    finally:
        r.close()


def wait_for_records(target: RunTarget, count: int, timeout_s: float, progress: Any = None) -> int:
    """Block until the records stream holds `count` entries; SuperviseError when a program fails or on
    timeout. progress(n) is called when the count changes. Returns the final count."""
    r = target.connect()
    deadline, seen = time.monotonic() + timeout_s, -1
    try:
        while True:
            n = int(r.xlen(target.keys.records))
            if n != seen and progress is not None:
                progress(n)
            seen = n
            if n >= count:
                return n
            failed = failed_programs(target.run_dir)
            if failed:
                raise SuperviseError(f"{'; '.join(failed)} (see {target.run_dir / 'logs'})")
            if time.monotonic() > deadline:
                raise SuperviseError(f"only {n} of {count} records after {timeout_s:.0f}s")
            time.sleep(0.5)
    finally:
        r.close()


#: Unexpected exits of one program (seen in supervisord's log) after which waiting for it is pointless.
CRASH_LOOP_EXITS = 3


def failed_programs(run_dir: Path) -> list[str]:
    """Programs supervisord gave up on (FATAL), that exited non-zero, or that keep crashing (restarted
    CRASH_LOOP_EXITS times), each with the last line of its log."""
    states = process_states(run_dir) or []
    crashes = Counter(c.split(":", 1)[0] for c in _crashes_from_log(run_dir))
    out = []
    for s in states:
        bad = s["statename"] in ("FATAL", "BACKOFF") or (s["statename"] == "EXITED" and s["exitstatus"] != 0)
        if bad or crashes[s["name"]] >= CRASH_LOOP_EXITS:
            why = f"{s['statename']}: {s['description']}, {crashes[s['name']]} unexpected exits"
            out.append(
                f"{s['name']} ({why}; last log line: {_last_line(run_dir / 'logs' / (s['name'] + '.log'))})"
            )
    return out


def _last_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "-"
    return lines[-1][-300:] if lines else "-"


# --- stopping ------------------------------------------------------------------------------------------


@dataclass
class ExitReport:
    """How each program ended: name -> exit status (None = never ran), plus unexpected exits seen in the
    supervisord log (crashes that were restarted count too)."""

    statuses: dict[str, int | None]
    crashes: list[str]

    @property
    def ok(self) -> bool:
        """True when every program that ran exited 0 and none crashed."""
        return not self.crashes and all(s in (None, 0) for s in self.statuses.values())

    def lines(self) -> list[str]:
        """One line per program, then each crash."""
        out = [
            f"{name:<12} {'never started' if st is None else f'exit {st}'}"
            for name, st in self.statuses.items()
        ]
        return out + [f"crash: {c}" for c in self.crashes]


_UNEXPECTED = re.compile(r"exited: (\S+) \((.*); not expected\)")


def _crashes_from_log(run_dir: Path) -> list[str]:
    log = run_dir / "logs" / "supervisord.log"
    if not log.is_file():
        return []
    return [f"{m.group(1)}: {m.group(2)}" for m in _UNEXPECTED.finditer(log.read_text(errors="replace"))]


def _stop_group(server: Any, run_dir: Path, names: list[str], timeout_s: float) -> None:
    for name in names:
        try:
            server.supervisor.stopProcess(name, False)
        except xmlrpc.client.Fault as e:
            if "NOT_RUNNING" not in e.faultString:
                raise
    _wait(
        lambda: all(
            s["statename"] not in ("STOPPING", "RUNNING", "STARTING", "BACKOFF")
            for s in server.supervisor.getAllProcessInfo()
            if s["name"] in names
        ),
        timeout_s,
        f"{', '.join(names)} to stop",
    )


def stop_run(run_dir: Path, timeout_s: float = WORKER_STOPWAIT_S + 30) -> ExitReport:
    """Stop producers, then trainer, then aggregator, then redis; shut supervisord down; report exits."""
    if not supervisor_up(run_dir):
        raise SuperviseError(f"no supervisord is up for {run_dir}")
    server = rpc(run_dir)
    record_primary(run_dir)
    infos = {s["name"]: s for s in server.supervisor.getAllProcessInfo()}
    order = [
        sorted(n for n in infos if n.startswith("rollout_")),
        ["trainer"],
        ["aggregator"],
        sorted(n for n in infos if n.startswith("sentinel_")),  # before the nodes: no failover on the way out
        ["redis", *sorted(n for n in infos if n.startswith("redis_"))],
    ]
    for names in order:
        present = [n for n in names if n in infos]
        if present:
            _stop_group(server, run_dir, present, timeout_s)
    infos = {s["name"]: s for s in server.supervisor.getAllProcessInfo()}
    statuses: dict[str, int | None] = {}
    for names in order:
        for n in names:
            if n in infos:
                statuses[n] = None if infos[n]["start"] == 0 else int(infos[n]["exitstatus"])
    pid_file = run_dir / "supervisord.pid"
    pid = int(pid_file.read_text()) if pid_file.is_file() else None
    server.supervisor.shutdown()
    if pid is not None:
        _wait(lambda: not _alive(pid), 30, "supervisord to exit")
    report = ExitReport(statuses, _crashes_from_log(run_dir))
    if report.ok:  # the programs' temp files go with them (a crash keeps them for a look)
        shutil.rmtree(run_dir / RUN_TMP_DIR, ignore_errors=True)
    return report


def record_primary(run_dir: Path) -> None:
    """For a run on the embedded replicated Redis: write which node's data folder is the primary's now
    (Sentinel says), so the stopped run's log is read from it (ops/log_server.py); nothing for other runs."""
    url_file, conf = run_dir / REDIS_URL_FILE, run_dir / CONF_NAME
    if not url_file.is_file() or not conf.is_file():
        return
    url = url_file.read_text().strip()
    if not is_sentinel_url(url):
        return
    pw_file = run_dir / SECRETS_DIR / SENTINEL_PASSWORD_FILE
    primary = sentinel_master(url, pw_file.read_text().strip() if pw_file.is_file() else None)
    data_dir = None if primary is None else data_dir_of(conf.read_text(), primary)
    if data_dir is not None:
        write_private(run_dir / PRIMARY_DATA_FILE, f"{data_dir}\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (foreground mode) counts as gone once supervisord removed its pidfile.
    return Path(f"/proc/{pid}").exists() and is_running(pid)
