"""Overrides of pipeline.yaml for a tiny whole run on the CPU, shared by the tests that start one through
`rollstream run` and by the benchmarks that do."""

from __future__ import annotations

#: The tiny GPT run: 2 producers, 4-sample global steps (2 local updates of 2), checkpoint every 2 steps,
#: no validation, 1000 global steps (more than a test waits for).
TINY = [
    "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "async_training.trigger_parameter_sync_step=2",
    "rollout.n=2", "rollout.num_producers=2", "rollout.prompts_per_dispatch=2", "rollout.stats_every_s=1",
    "model.d_model=16", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=24",
    "data.max_response_length=5", "data.reverse.max_digits=3", "data.epoch_size=256", "data.val_size=4",
    "trainer.test_freq=0", "trainer.save_freq=2", "trainer.total_training_steps=1000", "run.device=cpu",
    "bus.block_ms=200", "bus.claim_idle_s=5", f"bus.max_entry_bytes={256 << 10}",
]
