"""Rollout correction (rollstream/rl/rollout_correction.py) against hand-computed values, and in the learner.

Two sequences, the second one token shorter (its last column is padding, holding a wild log-ratio that
must never count):

  token                 s0t0   s0t1   s0t2   s1t0   s1t1   (s1t2 pad)
  p_rollout             0.4    0.2    0.1    0.8    0.5
  p_old (trainer)       0.4    0.4    0.4    0.4    0.5
  ratio p_old/p_roll    1      2      4      0.5    1
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from consumers.trainer.assembly import assemble_batch_from_rollout_samples
from consumers.trainer.learner import Learner
from rollstream.config import ConfigError, load_config
from rollstream.rl.rollout_correction import (
    is_weights,
    normalize_is_weights,
    offpolicy_metrics,
    probs_diff_metrics,
    rejection_mask,
    rollout_correction,
)
from rollstream.testing.fakes import fake_rollout_sample

approx = pytest.approx
LN2, LN4 = math.log(2), math.log(4)
P_ROLL = torch.tensor([[0.4, 0.2, 0.1], [0.8, 0.5, 0.3]], dtype=torch.float64)
P_OLD = torch.tensor([[0.4, 0.4, 0.4], [0.4, 0.5, 0.3 * math.exp(9)]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
LOG_RATIO = torch.tensor([[0.0, LN2, LN4], [-LN2, 0.0, 9.0]], dtype=torch.float64)  # = log P_OLD - log P_ROLL


def test_token_tis_truncates_each_token() -> None:
    w, m = is_weights(LOG_RATIO, MASK, "token", 3.0)
    assert w.flatten().tolist() == approx(sum([[1, 2, 3], [0.5, 1, 0]], []))
    assert m["rollout_is_mean"] == approx((1 + 2 + 3 + 0.5 + 1) / 5)
    assert m["rollout_is_ratio_fraction_high"] == approx(1 / 5)  # the raw 4 > 3
    assert m["rollout_is_ratio_fraction_low"] == 0.0  # nothing below 1/3
    assert (m["rollout_is_max"], m["rollout_is_min"]) == (approx(3.0), approx(0.5))
    assert m["rollout_is_seq_mean"] == approx((2 + 0.75) / 2)


def test_sequence_tis_uses_the_product_of_ratios() -> None:
    w, m = is_weights(LOG_RATIO, MASK, "sequence", 5.0)
    assert w.flatten().tolist() == approx(sum([[5, 5, 5], [0.5, 0.5, 0]], []))  # 1*2*4 = 8 -> 5; 0.5*1 = 0.5
    assert (m["rollout_is_max"], m["rollout_is_min"]) == (approx(8.0), approx(0.5))  # raw, from log space
    assert m["rollout_is_ratio_fraction_high"] == approx(1 / 2)


def test_icepop_zeroes_weights_outside_the_band() -> None:
    w, m = is_weights(LOG_RATIO, MASK, "token", "0.6_3")
    assert w.flatten().tolist() == approx(sum([[1, 2, 0], [0, 1, 0]], []))
    assert m["rollout_is_oob_ratio"] == approx(2 / 5)


def test_batch_normalisation_gives_mean_one() -> None:
    w, _ = is_weights(LOG_RATIO, MASK, "token", 3.0)
    normed, factor = normalize_is_weights(w, MASK, "token")
    assert factor == approx(1.5)
    assert (normed * MASK).sum() / MASK.sum() == approx(1.0)


@pytest.mark.parametrize(
    ("rs", "threshold", "kept"),
    [
        ("token_k1", 3.0, [[1, 1, 0], [1, 1, 0]]),  # p_roll/p_old 0.25 < 1/3 rejects that token only
        ("seq_max_k2", 0.5, [[0, 0, 0], [1, 1, 0]]),  # veto: s0's worst token (ln4)^2/2 = 0.96 > 0.5
        ("seq_mean_k1", "0.6_2", [[0, 0, 0], [1, 1, 0]]),  # geometric mean of p_roll/p_old: 0.5 and 1.41
        ("seq_sum_k3", 1.0, [[0, 0, 0], [1, 1, 0]]),  # s0: (2-1-ln2) + (4-1-ln4) = 1.92; s1: 0.19
        ("seq_sum_k1", "0.1_10", [[1, 1, 1], [1, 1, 0]]),  # product of p_roll/p_old: 1/8 and 2
        ("token_k1,seq_mean_k3", "3,0.2", [[0, 0, 0], [1, 1, 0]]),  # chained: every option must pass
    ],
)
def test_rejection_masks_tokens_and_sequences(rs: str, threshold: float | str, kept: list[list[int]]) -> None:
    mask, m = rejection_mask(LOG_RATIO, MASK, rs, threshold)
    assert mask.tolist() == kept
    rejected = 5 - sum(map(sum, kept))
    assert m["rollout_rs_masked_fraction"] == approx(rejected / 5)
    assert m["rollout_rs_seq_masked_fraction"] == approx(
        sum(1 for row, k in zip(MASK.tolist(), kept, strict=True) if sum(row) != sum(k)) / 2
    )


def test_rejection_statistics_by_hand() -> None:
    _, m = rejection_mask(LOG_RATIO, MASK, "seq_sum_k3", 1.0)
    s0 = (2 - 1 - LN2) + (4 - 1 - LN4)
    s1 = 0.5 - 1 + LN2
    assert m["rollout_rs_seq_sum_k3_max"] == approx(s0)
    assert m["rollout_rs_seq_sum_k3_min"] == approx(s1)
    assert m["rollout_rs_seq_sum_k3_fraction_high"] == approx(0.5)
    assert m["rollout_rs_seq_sum_k3_seq_masked_fraction"] == approx(0.5)


def test_mismatch_metrics_by_hand() -> None:
    m = probs_diff_metrics(P_OLD.log(), P_ROLL.log(), MASK)
    diffs = np.array([0.0, 0.2, 0.3, 0.4, 0.0])
    assert m["training/rollout_probs_diff_valid"] == 1.0
    assert m["training/rollout_probs_diff_max"] == approx(0.4)
    assert m["training/rollout_probs_diff_mean"] == approx(0.18)
    assert m["training/rollout_probs_diff_std"] == approx(math.sqrt(0.128 / 4))  # unbiased, as torch.std
    expected_r = np.corrcoef([0.4, 0.4, 0.4, 0.4, 0.5], [0.4, 0.2, 0.1, 0.8, 0.5])[0, 1]
    assert m["training/rollout_actor_probs_pearson_corr"] == approx(expected_r)
    assert diffs.max() == approx(m["training/rollout_probs_diff_max"])

    off = offpolicy_metrics(P_OLD.log(), P_ROLL.log(), MASK)
    assert off["kl"] == approx(-LN4 / 5)  # mean of log p_roll - log p_old over the 5 tokens
    assert off["chi2_token"] == approx((1 + 4 + 16 + 0.25 + 1) / 5 - 1)
    assert off["chi2_seq"] == approx((64 + 0.25) / 2 - 1)
    assert off["log_ppl_diff"] == approx((-LN2 + LN2 / 2) / 2)
    assert off["ppl_ratio"] == approx((0.5 + math.sqrt(2)) / 2)
    assert off["k3_kl"] == approx(((2 - 1 - LN2) + (4 - 1 - LN4) + (0.5 - 1 + LN2)) / 5)


def test_all_of_it_under_verls_names_and_no_valid_token() -> None:
    out = rollout_correction(P_OLD.log(), P_ROLL.log(), MASK, rollout_is="token", rollout_is_threshold=3.0,
                             rollout_rs="seq_max_k2", rollout_rs_threshold=0.5)
    assert out.weights is not None and out.mask.tolist() == [[0, 0, 0], [1, 1, 0]]
    for key in (
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_rs_masked_fraction",
        "rollout_corr/kl",
        "rollout_corr/chi2_seq",
        "training/rollout_probs_diff_max",
        "training/rollout_actor_probs_pearson_corr",
    ):
        assert key in out.metrics, key
    none = rollout_correction(P_OLD.log(), P_ROLL.log(), torch.zeros_like(MASK))
    assert none.metrics == {"training/rollout_probs_diff_valid": 0.0}
    with pytest.raises(ValueError, match="shapes differ"):
        rollout_correction(P_OLD.log(), P_ROLL.log()[:, :2], MASK)


# --- options ------------------------------------------------------------------------------------

TINY = ["model.d_model=16", "model.n_layer=1", "model.n_head=2", "model.max_seq_len=32", "run.device=cpu",
        "actor.ppo_mini_batch_size=2", "data.train_batch_size=4"]
RC = "algorithm.rollout_correction."


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([RC + "rollout_rs=token_k4", RC + "rollout_rs_threshold=2"], "rollout_rs option 'token_k4'"),
        ([RC + "rollout_rs=token_k1"], "rollout_rs_threshold=None must be given"),
        (
            [RC + "rollout_rs=seq_max_k2", RC + "rollout_rs_threshold=0.1_2"],
            "rollout_rs_threshold '0.1_2' for seq_max_k2",
        ),
        ([RC + "rollout_rs=token_k2,seq_sum_k3", RC + "rollout_rs_threshold=1,2,3"], "has 3 values"),
        ([RC + "rollout_is_threshold=3_2"], "rollout_is_threshold='3_2' needs 0 < lower <= upper"),
        ([RC + "rollout_is=seq"], "algorithm.rollout_correction.rollout_is='seq'"),
    ],
)
def test_bad_options_are_refused_naming_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, TINY + overrides)


def test_defaults_keep_the_old_truncated_weight_and_its_old_name_still_reads() -> None:
    rc = load_config(None, TINY).algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs) == ("token", 5.0, None)
    old = load_config(None, TINY + ["actor.behave_imp_cap=3"]).algorithm.rollout_correction
    assert (old.rollout_is, old.rollout_is_threshold) == ("token", 3.0)


# --- in the learner ------------------------------------------------------------------------------


def _batch() -> object:
    samples = [fake_rollout_sample(f"s{i}", n=4, prompt_len=5, response_len=6, seed=i) for i in range(2)]
    return assemble_batch_from_rollout_samples(samples)[0]


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_learner_logs_mismatch_metrics_every_update_and_rejection_silences_the_loss(mode: str) -> None:
    plain = Learner(load_config(None, TINY + [f"{RC}bypass_mode={mode == 'bypass'}"]))
    plain.begin_step()
    m = plain.update(_batch())
    # fake log-probs differ
    assert m["training/rollout_probs_diff_valid"] == 1.0 and m["rollout_corr/kl"] != 0.0
    assert ("rollout_corr/rollout_is_mean" in m) == (mode == "decoupled")  # bypass applies no IS weight
    # every token rejected (a k2 bound no real mismatch passes): nothing is trained on
    bypass = f"{RC}bypass_mode={mode == 'bypass'}"
    strict = Learner(load_config(None, TINY + [bypass, RC + "rollout_rs=token_k2",
                                               RC + "rollout_rs_threshold=1e-12"]))
    before = strict.policy.state_dict_bytes()
    strict.begin_step()
    m = strict.update(_batch())
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert m["actor/pg_loss"] == 0.0 and m["actor/grad_norm"] == 0.0
    assert strict.policy.state_dict_bytes() == before or m["actor/grad_norm"] == 0.0
