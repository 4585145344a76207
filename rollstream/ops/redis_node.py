"""Start one data node of the embedded replicated Redis (ops/redis_topology.py) without letting a lost node
wipe its replicas.

`python -m rollstream.ops.redis_node --url SENTINEL_URL --self HOST:PORT --data-dir DIR --marker FILE
--sentinel-password-file FILE -- redis-server ARGS…` execs redis-server ARGS, except in one case: the node
is planned as the primary (no --replicaof in ARGS), the topology has started before (FILE exists) and DIR
holds no AOF (its data is gone). A primary that came back empty would be copied by its replicas (they
resync from it), so instead it waits until the Sentinels name another primary, and starts as its replica."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import redis

from rollstream.bus.replication import parse_sentinel_url
from rollstream.files import private_dir
from rollstream.ops.redis_topology import has_data

log = logging.getLogger("redis_node")


def sentinel_master(url: str, password: str | None) -> str | None:
    """host:port of the primary the first answering Sentinel of `url` names, or None when none answers."""
    hosts, master, _ = parse_sentinel_url(url)
    for host, port in hosts:
        client = redis.Redis(host, port, password=password, socket_timeout=1, socket_connect_timeout=1)
        try:
            addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", master)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            continue
        finally:
            client.close()
        if addr:
            return f"{addr[0].decode()}:{addr[1].decode()}"
    return None


def start_argv(
    argv: list[str], url: str, self_addr: str, data_dir: Path, marker: Path, password: str | None,
    poll_s: float = 0.5,
) -> list[str]:
    """The redis-server argv to exec: `argv`, or for a lost primary (see the module docstring) `argv` with
    --replicaof the primary the Sentinels name once it is another node (waits until then)."""
    if "--replicaof" in argv:
        return argv
    if not marker.exists():
        marker.touch(mode=0o600)
        return argv
    if has_data(data_dir):
        return argv
    logged = False
    while True:
        primary = sentinel_master(url, password)
        if primary is not None and primary != self_addr:
            host, _, port = primary.rpartition(":")
            log.warning("%s: no data in %s; starting as a replica of %s", self_addr, data_dir, primary)
            return [*argv, "--replicaof", host, port]
        if not logged:
            log.warning(
                "%s: no data in %s and the Sentinels still name it the primary (%s): waiting for a failover "
                "rather than starting empty (its replicas would copy the empty set)", self_addr, data_dir,
                primary,
            )
            logged = True
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, decide the node's argv, exec redis-server."""
    parser = argparse.ArgumentParser(prog="python -m rollstream.ops.redis_node", description=__doc__)
    parser.add_argument("--url", required=True, help="redis+sentinel:// URL of the topology")
    parser.add_argument("--self", dest="self_addr", required=True, help="this node's host:port")
    parser.add_argument("--data-dir", required=True, help="this node's data folder (its AOF)")
    parser.add_argument("--marker", required=True, help="file marking that the topology started once")
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
