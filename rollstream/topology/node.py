"""Start one data node of the embedded replicated Redis (topology/replicated.py) in the role the Sentinels
give it, without letting a lost node wipe its replicas.

`python -m rollstream.topology.node --url SENTINEL_URL --self HOST:PORT --data-dir DIR --marker FILE
--sentinel-password-file FILE -- redis-server ARGS…` execs redis-server ARGS (their --replicaof is the plan:
node 0 the primary) on the node's first start (FILE does not exist yet); on every later start (a restart
after a crash or kill, a new `rollstream run`) it follows the Sentinels instead: a replica of the primary
they agree on, or the primary if they name this node and it has data. A primary that came back empty would
be copied by its replicas (they resync from it), so a named node whose data is gone waits for the failover
(`start_argv`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import redis

from rollstream.runtime.files import private_dir
from rollstream.topology.replicated import has_data
from rollstream.topology.replication import parse_sentinel_url

log = logging.getLogger("redis_node")


def sentinel_master(url: str, password: str | None) -> str | None:
    """host:port of the primary the Sentinels of `url` agree on: a majority of them answer and every answer
    names it. None otherwise (too few answer, or they disagree in the middle of a failover: a node that
    followed one Sentinel's view then could become a replica of a replica)."""
    hosts, master, _ = parse_sentinel_url(url)
    answers: list[str] = []
    for host, port in hosts:
        client = redis.Redis(host, port, password=password, socket_timeout=1, socket_connect_timeout=1)
        try:
            addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", master)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            continue
        finally:
            client.close()
        answers.append(f"{addr[0].decode()}:{addr[1].decode()}" if addr else "")
    if len(answers) <= len(hosts) // 2 or len(set(answers)) != 1 or not answers[0]:
        return None
    return answers[0]


def without_replicaof(argv: list[str]) -> list[str]:
    """argv without its `--replicaof HOST PORT`."""
    if "--replicaof" not in argv:
        return argv
    i = argv.index("--replicaof")
    return argv[:i] + argv[i + 3 :]


def start_argv(
    argv: list[str], url: str, self_addr: str, data_dir: Path, marker: Path, password: str | None,
    poll_s: float = 0.5,
) -> list[str]:
    """The redis-server argv to exec. The node's first start: `argv` as planned (node 0 the primary, the
    others its replicas). Every later start follows the Sentinels, never the plan (a replica promoted since
    must not come back as node 0's replica, nor node 0 as the primary): it waits until they agree on a
    primary, then starts as its replica, or, when they name this node and it has data, as the primary; a
    node they name whose data is gone waits for the failover that follows."""
    if not marker.exists():
        marker.touch(mode=0o600)
        return argv
    base = without_replicaof(argv)
    logged = ""
    while True:
        primary = sentinel_master(url, password)
        if primary is not None and primary != self_addr:
            host, _, port = primary.rpartition(":")
            log.warning("%s: starting as a replica of %s (the Sentinels' primary)", self_addr, primary)
            return [*base, "--replicaof", host, port]
        if primary == self_addr and has_data(data_dir):
            log.warning("%s: the Sentinels name it the primary; starting as the primary", self_addr)
            return base
        why = (
            "the Sentinels do not agree on a primary yet" if primary is None else
            f"no data in {data_dir} and the Sentinels still name it the primary: waiting for a failover "
            "rather than starting empty (its replicas would copy the empty set)"
        )
        if why != logged:
            log.warning("%s: %s", self_addr, why)
            logged = why
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, decide the node's argv, exec redis-server."""
    parser = argparse.ArgumentParser(prog="python -m rollstream.topology.node", description=__doc__)
    parser.add_argument("--url", required=True, help="redis+sentinel:// URL of the topology")
    parser.add_argument("--self", dest="self_addr", required=True, help="this node's host:port")
    parser.add_argument("--data-dir", required=True, help="this node's data folder (its AOF)")
    parser.add_argument("--marker", required=True, help="file marking that this node started once")
    parser.add_argument("--sentinel-password-file", default=None, help="file with the Sentinels' password")
    parser.add_argument("server", nargs=argparse.REMAINDER, help="-- redis-server and its arguments")
    args = parser.parse_args(argv)
    server = args.server[1:] if args.server[:1] == ["--"] else args.server
    if not server:
        parser.error("no redis-server command after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    pw_file = args.sentinel_password_file
    password = Path(pw_file).read_text().strip() if pw_file and Path(pw_file).is_file() else None
    private_dir(Path(args.data_dir))  # a lost disk: the node starts in a new, empty folder
    final = start_argv(server, args.url, args.self_addr, Path(args.data_dir), Path(args.marker), password)
    sys.stdout.flush()
    os.execv(final[0], final)


if __name__ == "__main__":
    main()
