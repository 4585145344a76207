"""Operations behind the `rollstream` CLI: launch/stop under supervisord, status, inspect, plot, replay."""
