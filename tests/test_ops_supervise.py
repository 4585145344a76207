"""supervisord config generation, the embedded redis-server, and a real supervisord lifecycle with stand-in
workers (start in order after setup_run, stop in order, exit statuses reported)."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

import pytest
import redis

from rollstream.cli.main import main
from rollstream.config import load_config
from rollstream.keys import Keys, producer_names
from rollstream.ops.embedded_redis import EmbeddedRedis, fit_to_host
from rollstream.ops.plan import PRIVATE_UMASK, plan_run, render_supervisord_conf, trainer_argv
from rollstream.ops.supervise import process_states, start_run, start_supervisord, stop_run

# Stand-in worker: logs its name, then on SIGTERM exits with the code given as argv[1].
STANDIN = (
    "import signal, sys, time, os\n"
    "code = int(sys.argv[1])\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(code))\n"
    "print('up', os.environ['SUPERVISOR_PROCESS_NAME'], os.environ['ROLLSTREAM_REDIS_URL'], flush=True)\n"
    "while True: time.sleep(0.05)\n"
)


def private_violations(run_dir: Path) -> list[str]:
    """`path mode` of everything under run_dir (itself included) that group or others may access (sockets
    aside: their access is the directory's); [] for a private run."""
    paths = [run_dir, *run_dir.rglob("*")]
    return [f"{p} {stat.S_IMODE(p.lstat().st_mode):o}" for p in paths
            if not p.is_socket() and stat.S_IMODE(p.lstat().st_mode) & PRIVATE_UMASK]


def sections(conf: str) -> dict[str, dict[str, str]]:
    """The supervisord.conf as {section: {key: value}}."""
    out: dict[str, dict[str, str]] = {}
    cur: dict[str, str] = {}
    for line in conf.splitlines():
        if line.startswith("["):
            cur = out.setdefault(line.strip("[]"), {})
        elif "=" in line and not line.startswith(";"):
            k, v = line.split("=", 1)
            cur[k.strip()] = v.strip()
    return out


def test_conf_for_external_redis_has_workers_and_no_password(tmp_path: Path) -> None:
    cfg = load_config("pipeline.yaml", [f"run.dir={tmp_path}", "run.name=ext", "rollout.num_producers=2",
                                        "run.redis_url=rediss://alice:s3cret@redis.example:6380/2?ssl_cert_reqs=none"])
    plan = plan_run(cfg)
    text = plan.conf_path.read_text()
    conf = sections(text)
    assert "program:redis" not in conf
    assert plan.workers == ["aggregator", "trainer", "rollout_00", "rollout_01"]
    trainer = conf["program:trainer"]
    assert trainer["stopwaitsecs"] == "60" and trainer["stopsignal"] == "TERM"
    assert trainer["autorestart"] == "unexpected"
    assert trainer["exitcodes"] == "0,2,6"  # EXIT_CONFIG, EXIT_REFUSED: fatal
    assert "-m consumers.trainer" in trainer["command"] and str(plan.resolved_config) in trainer["command"]
    assert (
        "-m producers" in conf["program:rollout_01"]["command"]
        and "--name rollout_01" in conf["program:rollout_01"]["command"]
    )
    env = conf["program:rollout_00"]["environment"]
    assert 'ROLLSTREAM_REDIS_URL="rediss://alice@redis.example:6380/2?ssl_cert_reqs=none"' in env
    assert 'PYTHONUNBUFFERED="1"' in env and "ROLLSTREAM_REDIS_PASSWORD_FILE" in env
    for path in (plan.conf_path, plan.resolved_config, plan.run_dir / "redis.url"):
        assert "s3cret" not in path.read_text()
    pw = plan.run_dir / "redis.password"
    assert pw.read_text() == "s3cret" and stat.S_IMODE(pw.stat().st_mode) == 0o600
    resolved = load_config(plan.resolved_config)
    assert resolved.run.redis_url is None and resolved.run.dir == str(tmp_path.resolve())


def test_latency_model_configs_get_latency_model_producers(tmp_path: Path) -> None:
    """Workers are launched by module name: a benchmark config's producers run benchmarks.latency_producer."""
    cfg = load_config("pipeline.yaml", [f"run.dir={tmp_path}", "run.name=lat", "run.redis_url=redis://127.0.0.1:6379/0",
                                        "rollout.num_producers=2", "bench.latency_model.enable=true"])
    conf = sections(plan_run(cfg).conf_path.read_text())
    for name in ("rollout_00", "rollout_01"):
        assert f"-m benchmarks.latency_producer {tmp_path.resolve()}" in conf[f"program:{name}"]["command"]
        assert f"--name {name}" in conf[f"program:{name}"]["command"]
    assert "-m consumers.trainer" in conf["program:trainer"]["command"]


def test_data_parallel_trainer_is_launched_by_torchrun(tmp_path: Path) -> None:
    """nproc_per_node > 1: one `trainer` program, torchrun (whose stop exits 0) running the trainer module;
    several hosts meet at the rendezvous endpoint under the run's name."""
    base = [f"run.dir={tmp_path}", "run.redis_url=redis://127.0.0.1:6379/0"]
    one = sections(plan_run(load_config("pipeline.yaml", [*base, "run.name=dp1", "trainer.nproc_per_node=2",
                                                          "trainer.max_restarts=5"])).conf_path.read_text())
    cmd = one["program:trainer"]["command"]
    assert "-m consumers.trainer.torchrun --nnodes=1 --nproc-per-node=2 --max-restarts=5" in cmd
    assert "--standalone -m consumers.trainer " in cmd and "--rdzv-endpoint" not in cmd
    many = load_config(
        "pipeline.yaml",
        [
            *base,
            "run.name=dpn",
            "trainer.nnodes=2",
            "trainer.nproc_per_node=4",
            "trainer.rdzv_endpoint=host0:29400",
        ],
    )
    assert trainer_argv(many, "c.yaml", "py") == [
        "py", "-m", "consumers.trainer.torchrun", "--nnodes=2", "--nproc-per-node=4", "--max-restarts=3",
        "--shutdown-timeout=45", "--rdzv-backend=c10d", "--rdzv-endpoint=host0:29400", "--rdzv-id=dpn",
        "-m", "consumers.trainer", "c.yaml"]
    assert trainer_argv(load_config("pipeline.yaml", base), "c.yaml", "py") == [
        "py",
        "-m",
        "consumers.trainer",
        "c.yaml",
    ]


def test_conf_for_embedded_redis_starts_redis_first_with_aof(tmp_path: Path) -> None:
    cfg = load_config("pipeline.yaml", [f"run.dir={tmp_path}", "run.name=emb"])
    plan = plan_run(cfg)
    conf = sections(plan.conf_path.read_text())
    red = conf["program:redis"]
    assert red["priority"] == "1" and red["autostart"] == "true"
    assert "--appendonly yes" in red["command"] and f"--dir {tmp_path.resolve()}/emb/redis" in red["command"]
    # one policy, stated once
    assert "--appendfsync always" in red["command"] and "everysec" not in red["command"]
    assert plan.redis_url == f"unix://{tmp_path.resolve()}/emb/redis.sock?db=0"
    assert f'ROLLSTREAM_REDIS_URL="{plan.redis_url}"' in conf["program:trainer"]["environment"]
    assert int(conf["program:rollout_00"]["priority"]) > int(conf["program:trainer"]["priority"])
    # issue 62: the warden, the run's one user manager, starts before the workers and stops after them
    warden = conf["program:warden"]
    assert warden["priority"] == "5" and "-m rollstream.ops.warden" in warden["command"]
    assert 'ROLLSTREAM_REDIS_USERNAME="warden"' in warden["environment"]
    assert 'ROLLSTREAM_REDIS_USERNAME="trainer"' in conf["program:trainer"]["environment"]
    # issue 41: a maxmemory sized from the budget, refusing writes rather than evicting the log
    assert f"--maxmemory {fit_to_host(cfg.bus.maxmemory())} --maxmemory-policy noeviction" in red["command"]
    bus = cfg.bus
    assert bus.maxmemory() == 3 * bus.redis_max_bytes + 4 * bus.weights_inline_max_bytes + (256 << 20)
    # issue 62: and never over half the host's memory, also where the config sets none
    assert fit_to_host(bus.maxmemory(), host_bytes=64 << 30) == bus.maxmemory()
    assert fit_to_host(bus.maxmemory(), host_bytes=8 << 30) == 4 << 30
    assert fit_to_host(None, host_bytes=8 << 30) == 4 << 30


def test_the_memory_bounds_are_checked_and_named() -> None:
    """bus.redis_maxmemory_bytes below twice the streams' budget is refused, naming both fields."""
    import pytest

    from rollstream.config import ConfigError

    why = r"redis_maxmemory_bytes=1000000 must be 0 .*redis_max_bytes=1048576"
    with pytest.raises(ConfigError, match=why):
        load_config(None, ["bus.redis_max_bytes=1048576", "bus.redis_maxmemory_bytes=1000000"])
    cfg = load_config(None, ["bus.weights_transport=redis"])
    assert cfg.bus.maxmemory() is None  # the weight chunks come on top: the operator sizes it
    assert load_config(None, ["bus.producer_max_bytes=5"]).bus.producer_bound() == 5
    kept = load_config(None, ["bus.retention=false"]).bus  # the whole log stays in Redis: no auto bound
    assert kept.maxmemory() is None and kept.producer_bound() is None


def test_a_run_dir_that_does_not_exist_is_created_private_with_its_parents(tmp_path: Path) -> None:
    import os
    import stat

    from rollstream.runtime.files import atomic_write, private_dir

    old = os.umask(0o022)  # a user's usual umask would make 0755 folders
    try:
        cfg = load_config("pipeline.yaml", [f"run.dir={tmp_path}/runs/nested", "run.name=fresh"])
        plan_run(cfg)
        atomic_write(tmp_path / "elsewhere" / "deep" / "f.bin", b"x")  # any folder a worker creates
    finally:
        os.umask(old)
    for d in (
        tmp_path / "runs",
        tmp_path / "runs" / "nested",
        tmp_path / "runs" / "nested" / "fresh",
        tmp_path / "runs" / "nested" / "fresh" / "redis",
        tmp_path / "elsewhere",
        tmp_path / "elsewhere" / "deep",
    ):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    (tmp_path / "shared").mkdir(mode=0o755)
    private_dir(tmp_path / "shared" / "mine")
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o755  # an existing parent keeps its mode
    assert private_violations(tmp_path / "runs") == []


def test_embedded_redis_starts_with_aof_and_keeps_data_across_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path)
    r = server.start()
    assert r.config_get("appendonly") == {"appendonly": "yes"}
    assert r.config_get("appendfsync") == {"appendfsync": "everysec"}
    r.set("k", "v")
    r.close()
    assert server.stop() == 0
    assert any((tmp_path / "redis").rglob("*.aof"))
    with EmbeddedRedis(tmp_path) as again:
        client = redis.Redis.from_url(again.url)
        assert client.get("k") == b"v"
        client.close()


def test_supervisord_lifecycle_with_standin_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config("pipeline.yaml", [f"run.dir={tmp_path}", "run.name=life", "rollout.num_producers=2"])
    plan = plan_run(cfg)
    standin = tmp_path / "standin.py"
    standin.write_text(STANDIN)
    for p in plan.programs:
        if p.name != "redis":
            p.argv = [sys.executable, str(standin), "5" if p.name == "trainer" else "0"]
    plan.conf_path.write_text(render_supervisord_conf(plan.run_dir, plan.programs, Path.cwd()))
    start_supervisord(plan)
    try:
        start_run(plan, cfg)
        admin_pw = (plan.run_dir / "secrets" / "admin.password").read_text()  # run.acl: default user off
        client = redis.Redis.from_url(plan.redis_url, username="admin", password=admin_pw)
        assert client.get(Keys("life").setup) == b"1"
        for p in producer_names(cfg.rollout.num_producers):  # one rollouts stream per producer
            assert client.xinfo_groups(Keys("life").rollouts_of(p))[0]["name"] == b"trainer"
        assert sorted(client.smembers(Keys("life").producers)) == [b"rollout_00", b"rollout_01"]
        client.close()
        logs = [plan.run_dir / "logs" / f"{n}.log" for n in plan.workers]
        deadline = time.monotonic() + 20
        while not all(f.is_file() and "up " in f.read_text() for f in logs) and time.monotonic() < deadline:
            time.sleep(0.05)  # stand-ins install their SIGTERM handler before printing "up"
        states = {s["name"]: s["statename"] for s in process_states(plan.run_dir) or []}
        assert set(states) == {"redis", "warden", "aggregator", "trainer", "rollout_00", "rollout_01"}
        assert main(["status", "--run-dir", str(plan.run_dir)]) == 0
        assert "rollout_01" in capsys.readouterr().out
    finally:
        code = main(["stop", "--run-dir", str(plan.run_dir)])
    out = capsys.readouterr().out
    assert code == 1  # the stand-in trainer exits 5 on SIGTERM
    assert "trainer      exit 5" in out and "rollout_00   exit 0" in out and "redis        exit 0" in out
    assert process_states(plan.run_dir) is None
    assert "up rollout_01 unix://" in (plan.run_dir / "logs" / "rollout_01.log").read_text()
    with pytest.raises(Exception, match="no supervisord"):
        stop_run(plan.run_dir)
    assert_private(plan.run_dir)


def assert_private(run_dir: Path) -> None:
    """A run's files are private to its user: the run dir is 0700 and nothing under it (AOF, logs, configs,
    secrets) is
    readable by group or others."""
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert private_violations(run_dir) == []
    assert any((run_dir / "redis").rglob("*.aof")) and any((run_dir / "logs").glob("*.log"))
