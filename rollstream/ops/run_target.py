"""Which run an operator command talks to: its config, key names, run dir and Redis URL (never printed
with a password)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis

from rollstream.bus import connect, read_password
from rollstream.config import ConfigError, PipelineConfig, load_config
from rollstream.keys import Keys
from rollstream.runtime.process import REDIS_URL_ENV
from rollstream.topology.replicated import SENTINEL_PASSWORD_FILE

#: The resolved config `rollstream run` writes into the run dir (every worker is started with it).
RESOLVED_CONFIG = "pipeline.resolved.yaml"
#: File in the run dir holding the Redis URL the run uses (password removed).
REDIS_URL_FILE = "redis.url"
#: Folder in the run dir with the per-role ACL passwords (0600) and redis' ACL file (see ops.plan).
SECRETS_DIR = "secrets"
#: ACL user the operator commands (stop, status, inspect …) connect as when the run has ACLs.
ADMIN_USER = "admin"
#: Fallback when nothing names a Redis.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def split_password(url: str) -> tuple[str, str | None]:
    """(url without its password, the password or None); user name, host, db and TLS params are kept."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}@{host}" if user else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)), parts.password


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, safe to print or log."""
    bare, password = split_password(url)
    if password is None:
        return url
    parts = urlsplit(bare)
    user = parts.username or ""
    return urlunsplit(
        (parts.scheme, f"{user}:***@{parts.netloc.split('@')[-1]}", parts.path, parts.query, "")
    )


@dataclass
class RunTarget:
    """A run as the CLI sees it: resolved config, key names, run dir and the Redis URL to use."""

    cfg: PipelineConfig
    keys: Keys
    run_dir: Path
    redis_url: str
    #: (user, password) to log in with instead of the run's own (a stopped run's private log server).
    login: tuple[str, str] | None = None
    #: True when the log is served from the stopped run's files for this command (ops/log_server.py).
    served: bool = False

    @property
    def admin_password_file(self) -> Path:
        """The admin role's password file (exists only when `rollstream run` set ACL users up)."""
        return self.run_dir / SECRETS_DIR / f"{ADMIN_USER}.password"

    def uses_acl(self) -> bool:
        """True when the run's embedded redis loads ACL users (its users.acl exists in the run dir)."""
        return (self.run_dir / SECRETS_DIR / "users.acl").is_file() and self.admin_password_file.is_file()

    def connect(self, retries: int = 2) -> redis.Redis:
        """A bytes client on the run's Redis: as admin with the run dir's password when the run has ACL
        users, else with the password from the URL, env or run.password_file."""
        password: str | None
        username: str | None
        if self.login is not None:
            username, password = self.login
        elif self.uses_acl():
            password, username = self.admin_password_file.read_text().strip(), ADMIN_USER
        else:
            password, username = read_password(self.cfg.run.password_file), None
        sentinels_pw = self.run_dir / SECRETS_DIR / SENTINEL_PASSWORD_FILE
        return connect(
            self.redis_url,
            socket_timeout_s=self.cfg.bus.socket_timeout_s,
            password=password,
            username=username,
            client_name=f"{self.cfg.run.name}:cli",
            retries=retries,
            sentinel_password=sentinels_pw.read_text().strip() if sentinels_pw.is_file() else None,
            run=self.keys.run,
        )


def resolve_redis_url(cfg: PipelineConfig, run_dir: Path) -> str:
    """run.redis_url, else the URL `rollstream run` recorded in the run dir, else $ROLLSTREAM_REDIS_URL,
    else the default local Redis."""
    if cfg.run.redis_url:
        return cfg.run.redis_url
    recorded = run_dir / REDIS_URL_FILE
    if recorded.is_file():
        return recorded.read_text().strip()
    return os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def open_run(config: str | None, overrides: list[str] | None = None, run_dir: str | None = None) -> RunTarget:
    """The run named by a config (+ overrides), or by a run dir holding pipeline.resolved.yaml; with
    neither, ./pipeline.yaml when present, else the defaults."""
    if run_dir is not None:
        resolved = Path(run_dir) / RESOLVED_CONFIG
        if not resolved.is_file():
            raise ConfigError(f"{resolved} not found: is {run_dir} a run dir made by `rollstream run`?")
        cfg = load_config(resolved, overrides)
        rdir = Path(run_dir)
    else:
        if config is None and Path("pipeline.yaml").is_file():
            config = "pipeline.yaml"
        cfg = load_config(config, overrides)
        rdir = cfg.run_dir()
    return RunTarget(cfg=cfg, keys=Keys(cfg.run.name), run_dir=rdir, redis_url=resolve_redis_url(cfg, rdir))
