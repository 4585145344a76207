"""`run.redis`: replicas, Sentinels and WAIT acknowledgements; bad values refused naming field and value."""

from __future__ import annotations

import pytest

from rollstream.config import ConfigError, config_to_yaml, load_config


def test_default_is_one_server_without_wait() -> None:
    cfg = load_config(None, [])
    assert cfg.run.redis.replicas == 0 and cfg.run.redis.sentinels == []
    assert not cfg.run.redis.replicated and cfg.run.redis.acks_needed() == 0


def test_replicas_wait_for_one_by_default_and_name_the_master_after_the_run() -> None:
    cfg = load_config(None, ["run.redis.replicas=2", "run.name=r1"])
    assert cfg.run.redis.replicated and cfg.run.redis.acks_needed() == 1
    assert cfg.run.redis.master_of(cfg.run.name) == "rollstream-r1"
    again = load_config(
        None, ["run.redis.replicas=2", "run.redis.wait_replicas=2", "run.redis.master_name=m"]
    )
    assert again.run.redis.acks_needed() == 2 and again.run.redis.master_of("x") == "m"
    assert "replicas: 2" in config_to_yaml(cfg)


def test_external_sentinels_parse() -> None:
    cfg = load_config(None, ['run.redis.sentinels=["10.0.0.1:26379", "[::1]:26380", "s3.example:26381"]'])
    assert cfg.run.redis.replicated and cfg.run.redis.acks_needed() == 1


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["run.redis.replicas=-1"], "run.redis.replicas=-1"),
        (["run.redis.replicas=6"], "run.redis.replicas=6"),
        (['run.redis.sentinels=["a:1", "b"]'], "run.redis.sentinels entry 'b' must be host:port"),
        (['run.redis.sentinels=["a:0"]'], "run.redis.sentinels entry 'a:0'"),
        (['run.redis.sentinels=["a:1"]', "run.redis.replicas=1"], "set one of them"),
        (["run.redis.replicas=1", "run.redis_url=redis://h:1/0"], "run.redis_url must be null"),
        (['run.redis.sentinels=["a:1"]', "run.redis_url=redis://h:1/0"], "leave run.redis_url null"),
        (["run.redis.replicas=1", "run.redis.wait_replicas=2"], "run.redis.wait_replicas=2 exceeds"),
        (["run.redis.quorum=4"], "run.redis.quorum=4"),
        (["run.redis.wait_timeout_ms=0"], "run.redis.wait_timeout_ms=0"),
        (["run.redis.down_after_ms=10"], "run.redis.down_after_ms=10"),
        (["run.redis.master_name=a b"], "run.redis.master_name='a b'"),
        (["run.redis.replica=1"], "replica"),
        (
            ["run.redis.replicas=1", "run.redis.wait_timeout_ms=20000"],
            "run.redis.wait_timeout_ms=20000 must be below bus.socket_timeout_s",
        ),
    ],
)
def test_bad_values_are_named(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)
