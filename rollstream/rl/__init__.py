"""RL math for rollstream, a module a concept: advantages, masked reductions, PPO losses and KL, rollout
correction, batch metrics (pure torch). The package itself imports nothing, so the config reads
`correction_spec` (the rollout-correction option grammar) without importing torch."""
