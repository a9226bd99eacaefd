"""The goodput model: step-time curves recovered from noisy synthetic measurements, the
exploration prior, confidence, and the gradient noise scale estimator."""

from __future__ import annotations

import numpy as np
import pytest

from nbtrain.core.goodputmodel import GoodputModel, GoodputSettings
from nbtrain.core.gradnoise import NoiseScale, efficiency
from nbtrain.core.speedup import SizeStats, StepTimeCurve, fit_step_time

# A well-scaling job (compute dominated) and a poorly scaling one (communication bound).
GOOD = StepTimeCurve(a=0.01, b=1.0, c=0.02, d=0.001, global_batch=1.0)
POOR = StepTimeCurve(a=0.05, b=1.0, c=0.4, d=0.02, global_batch=1.0)
SIZES = (1, 2, 4, 8, 16)


def _measure(curve: StepTimeCurve, sizes: tuple[int, ...], noise: float, seed: int,
             reps: int = 20) -> GoodputModel:
    rng = np.random.default_rng(seed)
    m = GoodputModel(ref_size=sizes[0])
    for n in sizes:
        for t in curve.step_s(n) * rng.lognormal(0.0, noise, size=reps):
            m.observe(n, float(t))
    return m


@pytest.mark.parametrize("truth", [GOOD, POOR], ids=["good", "poor"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fit_recovers_a_known_curve_from_noisy_step_times(truth: StepTimeCurve,
                                                              seed: int) -> None:
    m = _measure(truth, SIZES, noise=0.05, seed=seed)
    curve = m.curve()
    assert curve is not None
    for n in (1, 3, 6, 12, 16):  # measured and in-between sizes
        assert curve.step_s(n) == pytest.approx(truth.step_s(n), rel=0.05)
    # the shape the scheduler reads: speedup from 1 to 16 ranks
    want = truth.step_s(1) / truth.step_s(16)
    assert m.speedup(16) == pytest.approx(want, rel=0.05)


def test_the_fit_is_exact_without_noise_and_never_negative() -> None:
    stats = {}
    for n in SIZES:
        s = SizeStats()
        s.add(POOR.step_s(n), 10)
        stats[n] = s
    got = fit_step_time(stats.items())
    assert got is not None
    curve, rms = got
    assert rms < 1e-9
    for name in "abcd":
        assert getattr(curve, name) == pytest.approx(getattr(POOR, name), abs=1e-9)
    assert fit_step_time([]) is None


def test_two_sizes_give_a_two_coefficient_curve() -> None:
    m = _measure(GOOD, (4, 8), noise=0.0, seed=0, reps=1)
    curve = m.curve()
    assert curve is not None
    assert sum(1 for v in (curve.a, curve.b, curve.c, curve.d) if v > 0) <= 2
    assert curve.step_s(4) == pytest.approx(GOOD.step_s(4))
    assert curve.step_s(8) == pytest.approx(GOOD.step_s(8))


def test_a_poorly_scaling_job_gains_less_from_more_ranks() -> None:
    good = _measure(GOOD, SIZES, noise=0.05, seed=3)
    poor = _measure(POOR, SIZES, noise=0.05, seed=3)
    assert good.speedup(16) > 4 * poor.speedup(16)
    # marginal gain of 8 -> 16 ranks per added rank, relative to the average rank's
    for m, truth in ((good, GOOD), (poor, POOR)):
        want = truth.step_s(8) / truth.step_s(16) - 1.0
        assert m.speedup(16) / m.speedup(8) - 1.0 == pytest.approx(want, abs=0.1)
    assert good.speedup(16) / good.speedup(8) > 1.4 > 1.1 > poor.speedup(16) / poor.speedup(8)


def test_exploration_assumes_perfect_scaling_up_to_twice_the_largest_size() -> None:
    m = GoodputModel(ref_size=4)
    assert m.curve() is None and m.confidence(4) == 0.0
    assert m.speedup(8) == pytest.approx(2.0)  # nothing measured: throughput ~ n
    m.observe(4, 0.5)
    assert m.explore_limit() == 8
    assert m.throughput(4) == pytest.approx(2.0)  # 1 sample / 0.5 s
    assert m.speedup(8) == pytest.approx(2.0)
    assert m.speedup(32) == pytest.approx(2.0)  # no gain assumed past the limit
    assert m.confidence(8) == 0.0
    m.observe(8, 0.3)
    assert m.curve() is not None and m.explore_limit() == 16


def test_confidence_grows_with_sizes_and_falls_with_extrapolation_and_noise() -> None:
    few = _measure(GOOD, (4, 8), noise=0.02, seed=4)
    many = _measure(GOOD, (2, 4, 8, 16), noise=0.02, seed=4)
    noisy = _measure(GOOD, (2, 4, 8, 16), noise=0.5, seed=4, reps=3)
    assert 0.0 < few.confidence(8) < many.confidence(8) <= 1.0
    assert many.confidence(16) > many.confidence(32) > many.confidence(64) > 0.0
    assert many.confidence(6) == pytest.approx(many.confidence(8), rel=1e-9)  # inside range
    assert noisy.confidence(8) < 0.5 * many.confidence(8)


def test_bad_inputs_are_refused_with_the_values() -> None:
    m = GoodputModel(ref_size=2)
    with pytest.raises(ValueError, match="positive number of seconds"):
        m.observe(2, -1.0)
    with pytest.raises(ValueError, match="size must be >= 1"):
        m.observe(0, 1.0)
    with pytest.raises(ValueError, match="explore_factor"):
        GoodputSettings(explore_factor=0.5)
    with pytest.raises(ValueError, match="ref_size"):
        GoodputModel(ref_size=0)


def test_efficiency_falls_with_batch_past_the_noise_scale_and_scales_goodput() -> None:
    assert efficiency(256, 256, None) == 1.0
    assert efficiency(512, 256, 1e6) == pytest.approx(1.0, rel=1e-3)  # noisy: big batch pays
    assert efficiency(512, 256, 0.0) == pytest.approx(0.5)  # no noise: a bigger batch is waste
    weak = GoodputModel(ref_size=2, per_rank_batch=32.0, noise_scale=64.0)
    for n in (2, 4, 8):
        weak.observe(n, 0.1 + 0.01 * n)
    # throughput grows with n (more samples per step); goodput less so
    assert weak.throughput(8) / weak.throughput(2) > weak.speedup(8) > 1.0


@pytest.mark.parametrize("b_noise", [16.0, 256.0])
def test_the_noise_scale_estimate_recovers_a_known_noise_scale(b_noise: float) -> None:
    # Per-sample gradients g_i = G + noise, tr(Sigma) = b_noise * |G|^2.
    rng = np.random.default_rng(5)
    dim, ranks, local = 50, 4, 8
    g = rng.normal(size=dim)
    sigma = np.sqrt(b_noise * float(g @ g) / dim)
    est = NoiseScale(decay=0.999)
    for _ in range(3000):
        per_rank = g + rng.normal(0.0, sigma / np.sqrt(local), size=(ranks, dim))
        local_sq = float((per_rank**2).sum(axis=1).mean())
        reduced = per_rank.mean(axis=0)
        est.observe(local_sq, float(reduced @ reduced), local, local * ranks)
    assert est.value == pytest.approx(b_noise, rel=0.15)
    single = NoiseScale()
    single.observe(1.0, 1.0, 8, 8)  # one rank: its batch is the whole batch
    assert single.value is None
    with pytest.raises(ValueError, match="bad batch sizes"):
        single.observe(1.0, 1.0, 9, 8)
    with pytest.raises(ValueError, match="bad gradient-norm sample"):
        single.observe(float("nan"), 1.0, 3, 8)


def test_the_noise_scale_estimate_takes_an_uneven_split() -> None:
    # Rank 0 holds 5 of a global batch of 8: its local norm is over 5 samples, not 4.
    rng = np.random.default_rng(7)
    dim, b_noise, local, big = 40, 32.0, 5, 8
    g = rng.normal(size=dim)
    sigma = np.sqrt(b_noise * float(g @ g) / dim)
    est, wrong = NoiseScale(decay=0.999), NoiseScale(decay=0.999)
    for _ in range(4000):
        samples = g + rng.normal(0.0, sigma, size=(big, dim))
        mine, whole = samples[:local].mean(axis=0), samples.mean(axis=0)
        est.observe(float(mine @ mine), float(whole @ whole), local, big)
        wrong.observe(float(mine @ mine), float(whole @ whole), big / 2, big)
    assert est.value == pytest.approx(b_noise, rel=0.15)
    assert wrong.value is not None and abs(wrong.value - b_noise) > 0.3 * b_noise


def test_points_cover_the_multiples_of_the_replica_in_the_bounds() -> None:
    m = GoodputModel(ref_size=2)
    assert [p["size"] for p in m.points_between(3, 8, 2)] == [4.0, 6.0, 8.0]
    assert [p["size"] for p in m.points_between(1, 3)] == [1.0, 2.0, 3.0]
    assert all("step_s" not in p for p in m.points_between(1, 3))  # nothing measured yet


def test_one_size_with_its_phase_split_gives_a_first_curve() -> None:
    truth = StepTimeCurve(a=0.01, b=1.0, c=0.05, d=0.0)  # d = 0: one size recovers it exactly
    m = GoodputModel(ref_size=4)
    step = truth.step_s(4)
    m.observe(4, step, 50.0, compute_s=truth.b / 4, comm_s=truth.c)
    curve = m.curve()
    assert curve is not None
    for n in (2, 4, 8):
        assert curve.step_s(n) == pytest.approx(truth.step_s(n))
    assert curve.step_s(1) == pytest.approx(truth.a + truth.b)  # no all-reduce alone
    assert 0.0 < m.confidence(8) < m.confidence(4) <= 0.5  # one size: half a second one
    assert m.speedup(16) == pytest.approx(m.speedup(8))  # still valued up to 2x only
    m.observe(8, truth.step_s(8) * 1.1, 50.0)  # a second size: the step-time fit takes over
    fitted = m.curve()
    assert fitted is not None and fitted.step_s(8) == pytest.approx(truth.step_s(8) * 1.1)


def test_a_split_that_says_nothing_is_ignored() -> None:
    for compute, comm in ((0.0, 0.0), (float("nan"), 0.1), (0.2, -1.0), (0.2, float("inf"))):
        m = GoodputModel(ref_size=4)
        m.observe(4, 0.5, 10.0, compute_s=compute, comm_s=comm)
        assert m.curve() is None and m.speedup(8) == pytest.approx(2.0)  # exploration prior


def test_a_split_that_overruns_the_step_is_scaled_into_it() -> None:
    from nbtrain.core.speedup import split_curve

    c = split_curve(2, 1.0, compute_s=0.9, comm_s=0.3)  # phases timed apart: 1.2 s of 1 s
    assert c.a == pytest.approx(0.0) and c.step_s(2) == pytest.approx(1.0)
    assert c.c == pytest.approx(0.25)
    with pytest.raises(ValueError, match="step_s must be a positive"):
        split_curve(2, 0.0, compute_s=0.1, comm_s=0.1)


def test_two_sizes_with_their_splits_fix_all_four_terms() -> None:
    truth = StepTimeCurve(a=0.01, b=1.0, c=0.05, d=0.004)
    m = GoodputModel(ref_size=2)
    for n in (2, 8):
        comm = truth.c + truth.d * (n - 1)
        m.observe(n, truth.step_s(n), 30.0, compute_s=truth.b / n, comm_s=comm)
    curve = m.curve()
    assert curve is not None
    assert (curve.a, curve.b, curve.c, curve.d) == pytest.approx(
        (truth.a, truth.b, truth.c, truth.d))  # the step times alone allow two terms
    assert curve.step_s(32) == pytest.approx(truth.step_s(32))
    m.observe(4, truth.step_s(4), 30.0)  # a size without its split: the step-time fit
    fitted = m.curve()
    assert fitted is not None and sum(v > 0 for v in (fitted.a, fitted.b, fitted.c,
                                                      fitted.d)) <= 3


def test_a_split_fit_with_one_rank_measured_has_no_all_reduce_there() -> None:
    from nbtrain.core.speedup import fit_split

    fit = fit_split([(1, 10.0, 1.0, 0.9, 0.0), (4, 10.0, 0.4, 0.225, 0.075)])
    assert fit is not None
    curve, rms = fit
    assert curve.b == pytest.approx(0.9) and curve.c == pytest.approx(0.075)
    assert curve.d == 0.0 and curve.step_s(1) == pytest.approx(1.0)
    assert rms < 0.05
    assert fit_split([]) is None


def test_compute_that_does_not_shrink_with_the_batch_is_not_taken_to_scale() -> None:
    # The live test's flat job: its compute phase takes the same time at one rank and at two
    # (a fixed cost, or a device a smaller batch leaves idle), so more ranks do not help.
    m = GoodputModel(ref_size=1)
    m.observe(1, 0.13, 30.0, compute_s=0.12, comm_s=0.0)
    m.observe(2, 0.135, 30.0, compute_s=0.12, comm_s=0.005)
    curve = m.curve()
    assert curve is not None and curve.b == pytest.approx(0.0, abs=1e-9)
    assert m.speedup(2) == pytest.approx(0.13 / 0.135)
    assert m.speedup(2) < 1.0
