"""Data-parallel exactness: 2 ranks (gloo, spawned processes) and 1 rank trained on the same recorded samples
end with the same weights.

Each of 3 global steps has K = 2 local updates of a 4-sample mini-batch; the 2-rank run gives each rank 2
of each mini-batch's samples (whole GRPO groups; interleaved, so ranks pad differently). The property only
holds when the loss is normalised by counts summed over the ranks (Learner._dp_count), which
the control run without it shows: its weights differ.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import P0, PRODUCERS
from safetensors.torch import load as st_load

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.checkpoint import checkpoint_writer, read_checkpoint
from consumers.trainer.distributed import (
    DataParallel,
    DistributedError,
    RankInfo,
    check_strategy,
    consumer_name,
)
from consumers.trainer.learner import Learner
from consumers.trainer.roles import rank_info
from consumers.trainer.rounds import RoundClaim, resolve_round
from rollstream.config import load_config
from rollstream.rl.masked import agg_count, agg_loss
from rollstream.testing.fakes import fake_rollout_sample, leased_fakes
from rollstream.weights.tensors import state_bytes

TINY = [
    "model.d_model=16",
    "model.n_layer=1",
    "model.n_head=2",
    "model.max_seq_len=32",
    "run.device=cpu",
    "actor.ppo_mini_batch_size=4",
    "async_training.trigger_parameter_sync_step=2",
    "data.train_batch_size=8",
    "rollout.n=4",
]
STEPS, K, MINI = 3, 2, 4
#: name -> overrides of one exactness case (every loss aggregation, both off-policy modes, KL and entropy
#: terms, micro-batches)
CASES = {
    "token-mean": ["actor.loss_agg_mode=token-mean", "actor.kl_loss_coef=0.1", "actor.entropy_coeff=0.01"],
    "seq-mean-token-mean": [
        "actor.loss_agg_mode=seq-mean-token-mean", "algorithm.rollout_correction.bypass_mode=true"
    ],
    "seq-mean-token-sum": ["actor.loss_agg_mode=seq-mean-token-sum", "algorithm.adv_estimator=grpo_token"],
    "micro-batches": [
        "actor.loss_agg_mode=token-mean",
        "actor.micro_batch_size=3",
    ],  # DDP's no_sync accumulation
    # the batch-wide whitening's statistics are all-reduced: each rank's advantages are the whole batch's
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.5"],
}
CONTROL = "token-mean"  # also run with per-rank normalisation: must NOT match


def _samples() -> list[Any]:
    """STEPS * K * MINI recorded samples: ragged responses, prompts of different lengths."""
    return [
        fake_rollout_sample(f"s{i}", n=4, prompt_len=3 + i % 5, response_len=7, ragged=True, seed=i, vocab=20)
        for i in range(STEPS * K * MINI)
    ]


def _train(learner: Learner, rank: int, world: int) -> bytes:
    """3 global steps of K updates; this rank takes every world-th sample of each mini-batch."""
    samples = _samples()
    for g in range(1, STEPS + 1):
        learner.begin_step(g)
        for k in range(K):
            start = ((g - 1) * K + k) * MINI
            mini = samples[start : start + MINI]
            learner.update(assemble_batch_from_rollout_samples(mini[rank::world])[0])
    whole = learner.whole_weights()
    return state_bytes(whole) if whole else b""


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One spawned rank: join the gloo group, train every case (and the control), rank 0 saves the weights."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dp = DataParallel(RankInfo(rank, world, rank), torch.device("cpu"))
        for name, overrides in CASES.items():
            blob = _train(Learner(load_config(None, TINY + overrides), dp), rank, world)
            if rank == 0:
                Path(out_dir, f"{name}.safetensors").write_bytes(blob)
        # fsdp (CUDA-only in a run; its code runs on gloo here): the same weights, and a checkpoint round trip
        fsdp = DataParallel(RankInfo(rank, world, rank), torch.device("cpu"), "fsdp", fsdp_on_cpu=True)
        # validation's recent prompts: every fsdp rank decodes rank 0's; under ddp rank 0 decodes its own
        assert fsdp.broadcast_if_sharded([rank]) == [0] and dp.broadcast_if_sharded([rank]) == [rank]
        learner = Learner(load_config(None, TINY + CASES[CONTROL]), fsdp)
        blob = _train(learner, rank, world)
        weights, optim = learner.whole_weights(), learner.optimizer_state()
        ckpt_dir = Path(out_dir, "ckpt")
        path = checkpoint_writer(ckpt_dir, 3, weights, optim, {"steps": []})() if rank == 0 else None
        # as a resuming rank reads it
        data = fsdp.broadcast_bytes(path.read_bytes() if path is not None else None)
        resumed = Learner(load_config(None, TINY + CASES[CONTROL]), fsdp)
        resumed.load_checkpoint_state(*read_checkpoint(data, rank, world)[:2])
        again = resumed.whole_weights(), resumed.optimizer_state()
        if rank == 0:
            Path(out_dir, "fsdp.safetensors").write_bytes(blob)
            assert again[0].keys() == weights.keys() and all(
                torch.equal(again[0][k], weights[k]) for k in weights
            )
            assert again[1]["state"].keys() == optim["state"].keys()
            for i, st in optim["state"].items():
                for key, value in st.items():
                    assert torch.equal(torch.as_tensor(again[1]["state"][i][key]), torch.as_tensor(value)), (
                        i,
                        key,
                    )
        else:
            assert weights == {} and again[0] == {}  # whole weights reach rank 0 only
        Learner._dp_count = lambda self, total: (total, 1)  # type: ignore[method-assign]  # each rank's own counts
        blob = _train(Learner(load_config(None, TINY + CASES[CONTROL]), dp), rank, world)
        if rank == 0:
            Path(out_dir, "control.safetensors").write_bytes(blob)
    finally:
        dist.destroy_process_group()


#: float32 rounding after 6 AdamW steps: ranks and micro-batches pad and sum in other orders (seen: <= 3e-6);
#: per-rank normalisation (the control) is off by ~8e-3
RTOL, ATOL = 1e-5, 2e-5


def _assert_close(a: bytes, b: bytes, *, same: bool = True) -> None:
    ta, tb = st_load(a), st_load(b)
    assert ta.keys() == tb.keys()
    close = all(torch.allclose(ta[k], tb[k], rtol=RTOL, atol=ATOL) for k in ta)
    if same:
        for k in ta:
            torch.testing.assert_close(ta[k], tb[k], rtol=RTOL, atol=ATOL, msg=f"{k} differs")
    else:
        assert not close, "per-rank normalisation matched too: the test could not tell"


def test_two_ranks_end_with_the_weights_of_one(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    single = {name: _train(Learner(load_config(None, TINY + o)), 0, 1) for name, o in CASES.items()}
    init = tempfile.mktemp(prefix="rs-dp-init-", dir=tmp_path)
    mp.spawn(_rank_main, args=(2, init, str(tmp_path)), nprocs=2, join=True)
    for name, blob in single.items():
        _assert_close((tmp_path / f"{name}.safetensors").read_bytes(), blob)
    _assert_close((tmp_path / "fsdp.safetensors").read_bytes(), single[CONTROL])
    _assert_close((tmp_path / "control.safetensors").read_bytes(), single[CONTROL], same=False)


def test_counts_over_every_rank_give_the_global_loss() -> None:
    """Each rank's agg_loss times its count x ranks / every rank's count, averaged over ranks (what DDP
    does), is the loss over all rows (what Learner.update scales each micro-batch by)."""
    torch.manual_seed(0)
    losses = [torch.randn(3, 5), torch.randn(2, 5)]
    masks = [(torch.rand(3, 5) > 0.4).float(), (torch.rand(2, 5) > 0.4).float()]
    masks[1][0] = 0  # a row without valid tokens
    every_loss, every_mask = torch.cat(losses), torch.cat(masks)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        total = sum(agg_count(m, mode) for m in masks)
        shares = [
            agg_loss(x, m, mode) * agg_count(m, mode) * 2 / total for x, m in zip(losses, masks, strict=True)
        ]
        torch.testing.assert_close(sum(shares) / 2, agg_loss(every_loss, every_mask, mode))


def test_fsdp_refuses_cpu_and_names_are_rank_stable() -> None:
    with pytest.raises(DistributedError, match="trainer.strategy=fsdp needs CUDA"):
        check_strategy("fsdp", torch.device("cpu"))
    with pytest.raises(DistributedError, match="fsdp needs CUDA"):
        DataParallel(RankInfo(0, 2, 0), torch.device("cpu"), "fsdp")
    assert consumer_name("trainer", RankInfo(0, 1, 0)) == "trainer"  # a world of one keeps its old name
    assert [consumer_name("trainer", RankInfo(r, 2, r)) for r in (0, 1)] == ["trainer-r0", "trainer-r1"]


def _trainer_rank(rank: int, world: int, init_file: str, redis_url: str, overrides: list[str]) -> None:
    """One spawned trainer rank (gloo) running the real loop in burst mode on the test's Redis."""
    import threading

    import redis as redis_lib

    from consumers.trainer.loop import Trainer
    from rollstream.keys import Keys

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = load_config(None, overrides)
        r = redis_lib.Redis.from_url(redis_url)
        dp = DataParallel(RankInfo(rank, world, rank), torch.device("cpu"))
        Trainer(
            cfg,
            r,
            Keys(cfg.run.name),
            consumer_name("trainer", RankInfo(rank, world, rank)),
            threading.Event(),
            burst=True,
            dp=dp,
        ).run()
    finally:
        dp.close()


def test_two_trainer_ranks_train_a_sample_read_by_both_once(
    r: Any, keys: Any, redis_url: str, tmp_path: Path
) -> None:
    """Every id published twice in a row (a producer's retried XADD) reaches both ranks in one round (each
    reads one entry per round); the lower rank trains it, the other acks its copy without a fate."""
    from consumers.trainer.checkpoint import list_checkpoints
    from rollstream.bus import iter_stream, setup_run
    from rollstream.ops.audit import audit_run
    from schemas import StepMetrics, decode, decode_payload, encode

    overrides = TINY[:5] + [
        f"run.name={keys.run}",
        f"run.dir={tmp_path}",
        "actor.ppo_mini_batch_size=2",
        "async_training.trigger_parameter_sync_step=1",
        "data.train_batch_size=2",
        "rollout.n=2",
        "trainer.total_training_steps=4",
        "trainer.max_off_policy_threshold=1000",
        "trainer.test_freq=0",
        "trainer.save_freq=2",
        "trainer.nproc_per_node=2",
        "bus.block_ms=50",
    ]
    setup_run(r, keys, PRODUCERS)
    for s in leased_fakes(r, keys, 10, n=2, prompt_len=4, response_len=5, vocab=20):
        sample = encode(s)
        r.xadd(keys.rollouts_of(P0), sample)
        r.xadd(keys.rollouts_of(P0), sample)  # the duplicate right behind it
    init = tempfile.mktemp(prefix="rs-dp-init-", dir=tmp_path)
    mp.spawn(_trainer_rank, args=(2, init, redis_url, overrides), nprocs=2, join=True)

    rep = audit_run(r, keys)
    assert rep.duplicated == set() and rep.lost == set()
    assert rep.trained == {f"rollout_00-{i}" for i in range(8)}
    assert rep.steps == [1, 2, 3, 4]  # 4 steps of 2 samples
    assert rep.duplicate_entries == 10
    events = [ev for _, f in iter_stream(r, keys.metrics) if isinstance(ev := decode(f), StepMetrics)]
    updates = [e for e in events if e.type == "local_update"]
    assert sorted((e.global_step, e.rank, e.sample_count) for e in updates) == [
        (g, k, 1) for g in (1, 2, 3, 4) for k in (0, 1)
    ]
    consumers = {c["name"].decode(): c["pending"] for c in r.xinfo_consumers(keys.rollouts_of(P0), "trainer")}
    assert set(consumers) == {"trainer-r0", "trainer-r1"}
    ((_, newest),) = list_checkpoints(tmp_path / keys.run / "checkpoints")[-1:]
    meta = decode_payload(st_load(newest.read_bytes())["meta/payload"].numpy().tobytes())
    assert [rk["rank"] for rk in meta["ranks"]] == [0, 1] and all(rk["rng"]["torch"] for rk in meta["ranks"])
    got = sorted(sid for rk in meta["ranks"] for sid in rk["sample_ids"])
    assert got == [f"{P0}-{i}" for i in range(4, 8)]


def test_a_round_gives_an_id_taken_by_two_ranks_to_the_lower_one() -> None:
    claimed = {"old"}  # claimed in an earlier round or step
    claims = [
        RoundClaim(False, 1, [("a", True), ("b", False)]),
        RoundClaim(False, 1, [("a", True), ("old", True)]),
        RoundClaim(False, 2, []),
    ]
    for rank, dupes in ((0, []), (1, [0, 1]), (2, [])):
        seen = set(claimed)
        res = resolve_round(claims, seen, want=2, rank=rank)
        assert res.duplicates == dupes and seen == {"old", "a", "b"}
        assert not res.all_ready and not res.any_ended  # rank 1 kept only its earlier 1 of 2
    ready = resolve_round([RoundClaim(False, 1, [("c", True)]), RoundClaim(False, 2, [])], set(), 2, 0)
    assert ready.all_ready and not ready.any_ended
    stop = resolve_round([RoundClaim(False, 2, []), RoundClaim(True, 0, [])], set(), 2, 0)
    assert stop.any_ended and not stop.all_ready
    assert RoundClaim.from_plain(claims[0].to_plain()) == claims[0]
    assert rank_info({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == RankInfo(1, 2, 1)
    assert rank_info({}) == RankInfo(0, 1, 0)
