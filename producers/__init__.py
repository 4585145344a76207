"""Rollout producers: prompt -> generate (policy) -> reward -> RolloutSample -> XADD
(run `python -m producers`)."""
