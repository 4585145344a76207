"""The launch plan of a run under supervisord: the run dir (private), the resolved config, the ACL users
and their passwords, and supervisord.conf with one program per process. Starting and stopping the
programs is ops/supervise.py.

With an embedded redis and `run.acl` (the default), each program connects as its own ACL user
(producer, trainer, aggregator; the CLI as admin; the default user is off): passwords are generated into
0600 files under <run_dir>/secrets, redis loads the users (sha256 hashes only) from <run_dir>/secrets/
users.acl at every start (so a restarted redis keeps them), and programs get ROLLSTREAM_REDIS_USERNAME +
ROLLSTREAM_REDIS_PASSWORD_FILE. The embedded redis fsyncs its AOF on every write (`appendfsync always`),
so a redis killed with SIGKILL loses nothing it acknowledged.

A run's files are private to its user: the run dir and its folders are 0700, the files written here 0600,
and supervisord runs every program with umask 077, so the AOF, checkpoints, logs and records.jsonl are
created 0600 too (the ACL protects Redis; this protects its files on the host).

Programs and their priorities (supervisord stops higher numbers first on its own shutdown, so producers
stop before the trainer, the trainer before the aggregator, and redis last):

    redis 1 (only when run.redis_url is null) · warden 5 (only with ACL users) · aggregator 10 · trainer 20 ·
    rollout_NN 30

The warden (rollstream/ops/warden.py) is the run's one user manager: it fences the producers the trainer
names in `fenced`, under a user that may read that hash and nothing else of the run's data.

Workers are launched by module name (`python -m consumers.trainer` …): the runtime imports no worker
package. A data-parallel trainer (`trainer.nproc_per_node` or `trainer.nnodes` above 1, or fsdp) is one
program too: `python -m consumers.trainer.torchrun … -m consumers.trainer` (torchrun, whose stop exits 0),
which starts and restarts the ranks (`trainer_argv`); its ranks run in sessions of their own, so
supervisord's SIGTERM reaches torchrun alone, and torchrun forwards it to each rank once. A config with
`bench.latency_model.enable` (benchmarks) gets latency-model producers
(`python -m benchmarks.latency_producer`: the producer with a modelled decode injected).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollstream.bus.connection import PASSWORD_FILE_ENV, SENTINEL_PASSWORD_FILE_ENV, USERNAME_ENV
from rollstream.config import PipelineConfig, config_to_yaml
from rollstream.keys import Keys
from rollstream.keys import producer_names as _producer_names
from rollstream.ops.acl import ROLES, acl_rules, generate_passwords
from rollstream.ops.embedded_redis import MAX_UNIX_SOCKET_PATH, fit_to_host, plan_embedded
from rollstream.ops.run_target import REDIS_URL_FILE, RESOLVED_CONFIG, SECRETS_DIR, split_password
from rollstream.runtime.files import PRIVATE_UMASK, private_dir
from rollstream.runtime.process import EXIT_CONFIG, EXIT_REFUSED, REDIS_URL_ENV
from rollstream.topology.replicated import (
    PRIMARY_DATA_FILE,
    REPLICATION_USER,
    SENTINEL_PASSWORD_FILE,
    SENTINEL_USER,
    SENTINELS_USER,
    plan_topology,
    topology_acl_lines,
)
from rollstream.topology.replication import sentinel_url

#: Seconds supervisord waits after SIGTERM before SIGKILL; longer than any worker's unit of work.
WORKER_STOPWAIT_S = 60
REDIS_STOPWAIT_S = 30
CONF_NAME = "supervisord.conf"
PASSWORD_FILE = "redis.password"
#: redis ACL file (users with sha256 password hashes) inside the secrets dir.
ACL_FILE = "users.acl"
#: Folder in the run dir that is its programs' TMPDIR (removed by a clean `rollstream stop`).
RUN_TMP_DIR = "tmp"
#: supervisord program name -> ACL user it connects as (each producer connects as a user of its own name).
PROGRAM_ROLES = {"aggregator": "aggregator", "trainer": "trainer", "warden": "warden"}
#: Module the warden program runs (`python -m …`).
WARDEN_MODULE = "rollstream.ops.warden"
#: Module a producer program runs (`python -m …`), and the one of latency-model producers (benchmarks).
PRODUCER_MODULE = "producers"
LATENCY_PRODUCER_MODULE = "benchmarks.latency_producer"


class SuperviseError(RuntimeError):
    """A run could not be started or stopped (message says why)."""


@dataclass
class Program:
    """One [program:x] section."""

    name: str
    argv: list[str]
    priority: int
    stopwaitsecs: int = WORKER_STOPWAIT_S
    autostart: bool = False
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class RunPlan:
    """Everything `rollstream run` writes and starts for one run."""

    run_dir: Path
    conf_path: Path
    resolved_config: Path
    redis_url: str
    programs: list[Program]

    @property
    def workers(self) -> list[str]:
        """Worker program names in start order (aggregator, trainer, producers)."""
        return [p.name for p in self.programs if not is_server_program(p.name)]


def is_server_program(name: str) -> bool:
    """True for a program of the run's own Redis: `redis`, replica `redis_<i>`, Sentinel `sentinel_<j>`."""
    return name == "redis" or name.startswith(("redis_", "sentinel_"))


def supervisor_socket(run_dir: Path) -> Path:
    """supervisord's unix socket: in the run dir, or under the temp dir when that path is too long."""
    run_dir = run_dir.resolve()
    sock = run_dir / "supervisor.sock"
    if len(str(sock)) <= MAX_UNIX_SOCKET_PATH:
        return sock
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"rollstream-{digest}.sock"


def producer_names(cfg: PipelineConfig) -> list[str]:
    """rollout_00 … rollout_NN, one per rollout.num_producers."""
    return _producer_names(cfg.rollout.num_producers)


def producer_module(cfg: PipelineConfig) -> str:
    """The module a producer of this config runs: latency-model producers for
    `bench.latency_model.enable`."""
    return LATENCY_PRODUCER_MODULE if cfg.bench.latency_model.enable else PRODUCER_MODULE


#: Module of the torchrun launcher of a data-parallel trainer (torchrun whose requested stop exits 0).
TORCHRUN_MODULE = "consumers.trainer.torchrun"
#: Seconds torchrun waits for its ranks to drain after SIGTERM before SIGKILL (below WORKER_STOPWAIT_S).
TORCHRUN_SHUTDOWN_S = WORKER_STOPWAIT_S - 15


def trainer_argv(cfg: PipelineConfig, conf: str, python: str | None = None) -> list[str]:
    """The trainer program's command: `python -m consumers.trainer CONF`, or for a data-parallel trainer the
    same module under torchrun: one host standalone, or `nnodes` hosts meeting at `rdzv_endpoint` (c10d,
    rendezvous id = the run name; every host runs this same command)."""
    py = python or sys.executable
    t = cfg.trainer
    if not t.distributed:
        return [py, "-m", "consumers.trainer", conf]
    argv = [py, "-m", TORCHRUN_MODULE, f"--nnodes={t.nnodes}", f"--nproc-per-node={t.nproc_per_node}",
            f"--max-restarts={t.max_restarts}", f"--shutdown-timeout={TORCHRUN_SHUTDOWN_S}"]
    if t.rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={t.rdzv_endpoint}", f"--rdzv-id={cfg.run.name}"]
    else:
        argv.append("--standalone")
    return [*argv, "-m", "consumers.trainer", conf]


def _worker_programs(
    cfg: PipelineConfig, resolved: Path, env: dict[str, str], role_env: dict[str, dict[str, str]]
) -> list[Program]:
    py, conf = sys.executable, str(resolved)
    progs = [
        Program("warden", [py, "-m", WARDEN_MODULE, conf], priority=5, env={**env, **role_env["warden"]})
    ] if "warden" in role_env else []
    progs += [
        Program(
            "aggregator",
            [py, "-m", "consumers.aggregator", conf],
            priority=10,
            env={**env, **role_env.get("aggregator", {})},
        ),
        Program(
            "trainer", trainer_argv(cfg, conf, py), priority=20, env={**env, **role_env.get("trainer", {})}
        ),
    ]
    for name in producer_names(cfg):
        progs.append(Program(name, [py, "-m", producer_module(cfg), conf, "--name", name], priority=30,
                             env={**env, **role_env.get(name, {})}))
    return progs


def write_acl(
    run_dir: Path, keys: Keys, producers: list[str], extra_lines: Sequence[str] = ()
) -> tuple[Path, dict[str, dict[str, str]]]:
    """Generate (or reuse) the users' passwords (one user per producer) and write redis' ACL file (hashes
    only, 0600, default user off, then `extra_lines`: a replicated topology's `replication` and `sentinel`
    users); returns (ACL file, user -> the env a program of that user gets)."""
    secrets_dir = run_dir / SECRETS_DIR
    users = [*ROLES, *producers]
    files = generate_passwords(secrets_dir, users)
    rules = acl_rules(keys, producers)
    # The default user is off (no connection can use it) but keeps +@all: redis 7.0 replays the AOF's
    # MULTI/EXEC blocks with the default user's permissions, and a `nocommands` default user makes it drop
    # every transaction on load (seen in tests/test_faults.py: a restarted redis came back empty).
    lines = ["user default off resetpass resetchannels +@all ~*"]
    for role in users:
        digest = hashlib.sha256(files[role].read_text().strip().encode()).hexdigest()
        lines.append(" ".join(["user", role, "on", f"#{digest}", "resetchannels", *rules[role]]))
    lines += extra_lines
    acl_file = secrets_dir / ACL_FILE
    fd = os.open(acl_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    env = {role: {USERNAME_ENV: role, PASSWORD_FILE_ENV: str(files[role].resolve())} for role in users}
    return acl_file, env


def _replicated_programs(
    cfg: PipelineConfig, run_dir: Path
) -> tuple[str, list[Program], dict[str, dict[str, str]]]:
    """The embedded replicated Redis (topology/replicated.py): (Sentinel URL, its programs, role env). Data
    nodes start first (priority 1), Sentinels after them (2) and stop before them; every node fsyncs its AOF
    on every write and loads the run's ACL file, which also holds the `replication` and `sentinel` users."""
    secrets_dir = run_dir / SECRETS_DIR
    files = generate_passwords(secrets_dir, [REPLICATION_USER, SENTINEL_USER, SENTINELS_USER])
    passwords = {user: path.read_text().strip() for user, path in files.items()}
    role_env: dict[str, dict[str, str]] = {}
    acl_file: Path | None = None
    if cfg.run.acl:
        acl_file, role_env = write_acl(
            run_dir, Keys(cfg.run.name), producer_names(cfg), extra_lines=topology_acl_lines(passwords)
        )
    else:
        (secrets_dir / ACL_FILE).unlink(missing_ok=True)
    rc = cfg.run.redis
    topo = plan_topology(
        run_dir, rc.replicas, rc.master_of(cfg.run.name), secrets_dir, acl_file=acl_file, passwords=passwords,
        appendfsync="always", maxmemory=fit_to_host(cfg.bus.maxmemory()), quorum=rc.quorum,
        down_after_ms=rc.down_after_ms, failover_timeout_ms=rc.failover_timeout_ms,
    )
    programs = [
        Program(n.name, n.argv, priority=1, stopwaitsecs=REDIS_STOPWAIT_S, autostart=True) for n in topo.nodes
    ]
    programs += [
        Program(s.name, s.argv, priority=2, stopwaitsecs=REDIS_STOPWAIT_S, autostart=True)
        for s in topo.sentinels
    ]
    return topo.url, programs, role_env


def write_private(path: Path, text: str) -> None:
    """Write a text file readable by its owner only (0600, also when it already existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def plan_run(cfg: PipelineConfig, run_dir: Path | None = None) -> RunPlan:
    """Write the resolved config (absolute run.dir, no password in it), redis.url and supervisord.conf
    into the run dir; return the plan. The Redis password, if any, goes to a 0600 file named by env."""
    run_dir = private_dir((run_dir or cfg.run_dir()).resolve())
    private_dir(run_dir / "logs")
    resolved_cfg = cfg.model_copy(deep=True)
    resolved_cfg.run.dir = str(run_dir.parent)
    # the programs' temp files (torch's torchinductor_<user> cache folder, torchrun's torchelastic_*) stay in
    # the run dir, not /tmp; `rollstream stop` removes the folder after a clean stop
    env = {"PYTHONUNBUFFERED": "1", "TMPDIR": str(private_dir(run_dir / RUN_TMP_DIR))}
    programs: list[Program] = []
    role_env: dict[str, dict[str, str]] = {}
    (run_dir / PRIMARY_DATA_FILE).unlink(missing_ok=True)  # `rollstream stop` records it again
    if cfg.run.redis_url is None and cfg.run.redis.replicas:
        url, servers, role_env = _replicated_programs(cfg, run_dir)
        programs += servers
        env[SENTINEL_PASSWORD_FILE_ENV] = str((run_dir / SECRETS_DIR / SENTINEL_PASSWORD_FILE).resolve())
    elif cfg.run.redis_url is None and cfg.run.redis.sentinels:
        url = sentinel_url(cfg.run.redis.sentinels, cfg.run.redis.master_of(cfg.run.name))
    elif cfg.run.redis_url is None:
        # a kill -9 of redis loses nothing acknowledged
        redis_argv, url = plan_embedded(
            run_dir, appendfsync="always", maxmemory=fit_to_host(cfg.bus.maxmemory())
        )
        if cfg.run.acl:
            acl_file, role_env = write_acl(run_dir, Keys(cfg.run.name), producer_names(cfg))
            redis_argv += ["--aclfile", str(acl_file)]
        else:
            (run_dir / SECRETS_DIR / ACL_FILE).unlink(missing_ok=True)  # operator commands connect as default
        programs.append(
            Program("redis", redis_argv, priority=1, stopwaitsecs=REDIS_STOPWAIT_S, autostart=True)
        )
    else:
        url, password = split_password(cfg.run.redis_url)
        resolved_cfg.run.redis_url = None
        if password is not None:
            pw_file = run_dir / PASSWORD_FILE
            write_private(pw_file, password)
            resolved_cfg.run.password_file = str(pw_file)
    if resolved_cfg.run.password_file:
        env[PASSWORD_FILE_ENV] = str(Path(resolved_cfg.run.password_file).resolve())
    env[REDIS_URL_ENV] = url
    resolved = run_dir / RESOLVED_CONFIG
    write_private(resolved, config_to_yaml(resolved_cfg))
    write_private(run_dir / REDIS_URL_FILE, url + "\n")
    programs += _worker_programs(cfg, resolved, env, role_env)
    conf = run_dir / CONF_NAME
    write_private(conf, render_supervisord_conf(run_dir, programs, cwd=Path.cwd()))
    return RunPlan(run_dir, conf, resolved, url, programs)


def _esc(text: str) -> str:
    """Escape supervisord's %(name)s expansion."""
    return text.replace("%", "%%")


def render_supervisord_conf(run_dir: Path, programs: list[Program], cwd: Path) -> str:
    """supervisord.conf text: its socket, pidfile and log in the run dir, one section per program."""
    logs = run_dir / "logs"
    sock = supervisor_socket(run_dir)
    lines = [
        "; written by `rollstream run`; regenerated on every run",
        "[unix_http_server]",
        f"file={_esc(str(sock))}",
        "chmod=0700",
        "",
        "[supervisord]",
        f"logfile={_esc(str(logs / 'supervisord.log'))}",
        f"pidfile={_esc(str(run_dir / 'supervisord.pid'))}",
        f"childlogdir={_esc(str(logs))}",
        f"identifier=rollstream-{run_dir.name}",
        # every program (redis' AOF, checkpoints, logs, sinks) creates 0600 files
        f"umask={PRIVATE_UMASK:03o}",
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "",
        "[supervisorctl]",
        f"serverurl=unix://{_esc(str(sock))}",
    ]
    for p in programs:
        if any("\n" in a for a in p.argv) or any("\n" in v or '"' in v for v in p.env.values()):
            raise SuperviseError(f"program {p.name}: newlines or quotes cannot go into supervisord.conf")
        env = ",".join(f'{k}="{_esc(v)}"' for k, v in p.env.items())
        lines += [
            "",
            f"[program:{p.name}]",
            f"command={_esc(shlex.join(p.argv))}",
            f"directory={_esc(str(cwd))}",
            f"priority={p.priority}",
            f"umask={PRIVATE_UMASK:03o}",
            f"autostart={'true' if p.autostart else 'false'}",
            "autorestart=unexpected",
            # 2 (EXIT_CONFIG: a bad config, an engine that cannot start) and 6 (EXIT_REFUSED: Redis refused
            # the login, e.g. a fenced producer) are fatal: restarting cannot help, so the program stays
            # EXITED with its status, which `run`, `watch` and `status --check` report
            f"exitcodes=0,{EXIT_CONFIG},{EXIT_REFUSED}",
            "startsecs=1",
            "startretries=3",
            "stopsignal=TERM",
            f"stopwaitsecs={p.stopwaitsecs}",
            "stopasgroup=true",
            "killasgroup=true",
            "redirect_stderr=true",
            f"stdout_logfile={_esc(str(logs / (p.name + '.log')))}",
            "stdout_logfile_maxbytes=50MB",
            "stdout_logfile_backups=2",
        ]
        if env:
            lines.append(f"environment={env}")
    return "\n".join(lines) + "\n"
