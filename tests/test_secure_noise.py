"""The exact discrete Laplace and discrete Gaussian samplers (Canonne, Kamath and Steinke 2020) and the
grid mechanisms built on them: distributions against their closed forms, outputs on the grid, the
epsilon stated for the discrete Gaussian, and the deployed enclave's use of them.

The samplers draw from the OS's CSPRNG, so these tests check distributional properties with enough
draws (20 000) and bounds generous enough that a correct sampler fails with probability below 1e-6."""

from __future__ import annotations

import math
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats

from fedveil.core.attestation_verify import EnclaveClientSession, SimulatedQuoteVerifier
from fedveil.enclave.dp import dp_release, private_derivatives
from fedveil.enclave.measure import EnclaveConfig, measure_enclave
from fedveil.enclave.secure_noise import (
    SECURE_NOISE_BYTES_PER_VALUE,
    SecureNoise,
    bernoulli_exp,
    discrete_gaussian,
    discrete_laplace,
    grid_sensitivity,
    zcdp_epsilon,
)
from fedveil.enclave.service import alg2_bytes
from fedveil.errors import ConfigError
from fedveil.privacy.accounting import Accountant, GaussianRelease
from fedveil.protocols.fedavg import ClipAndNoise, FitResult
from fedveil.protocols.polifl import DPAggregate
from fedveil.runtime.enclave_host import EnclaveHost
from fedveil.runtime.quoting import SimulatedPlatform
from fedveil.service.network import device_pool

DRAWS = 20_000
MIN_P_VALUE = 1e-6


def chi_square_p(samples: np.ndarray, pmf: dict[int, float]) -> float:
    """Pearson's chi-square p-value of ``samples`` against ``pmf``: one bin per value expected at least
    5 times, the rest pooled."""
    values = [v for v in sorted(pmf) if pmf[v] * samples.size >= 5]
    observed = [int(np.sum(samples == v)) for v in values]
    expected = [pmf[v] * samples.size for v in values]
    observed.append(samples.size - sum(observed))
    expected.append(samples.size - sum(expected))
    return float(stats.chisquare(observed, expected).pvalue)


def laplace_pmf(scale: float, y: int) -> float:
    p = math.exp(-1 / scale)
    return (1 - p) / (1 + p) * p ** abs(y)


def gaussian_pmf(sigma2: float, support: range) -> dict[int, float]:
    norm = sum(math.exp(-(k * k) / (2 * sigma2)) for k in range(-2000, 2001))
    return {y: math.exp(-(y * y) / (2 * sigma2)) / norm for y in support}


@pytest.mark.parametrize("scale", [0.3, 1.0, 2.5])
def test_discrete_laplace_pmf_mean_and_variance(scale: float) -> None:
    y = discrete_laplace(scale, DRAWS)
    assert y.dtype == np.int64 and y.shape == (DRAWS,)
    assert chi_square_p(y, {k: laplace_pmf(scale, k) for k in range(-8, 9)}) > MIN_P_VALUE
    p = math.exp(-1 / scale)
    variance = 2 * p / (1 - p) ** 2
    assert abs(y.mean()) < 6 * math.sqrt(variance / DRAWS)
    assert y.var() == pytest.approx(variance, rel=0.12)


@pytest.mark.parametrize("sigma2", [Fraction(1, 4), Fraction(9, 4), 7.0])
def test_discrete_gaussian_pmf_mean_and_variance(sigma2: Fraction | float) -> None:
    y = discrete_gaussian(sigma2, DRAWS)
    s2 = float(sigma2)
    pmf = gaussian_pmf(s2, range(-12, 13))
    assert chi_square_p(y, pmf) > MIN_P_VALUE
    variance = sum(k * k * q for k, q in gaussian_pmf(s2, range(-60, 61)).items())
    assert abs(y.mean()) < 6 * math.sqrt(variance / DRAWS)
    assert y.var() == pytest.approx(variance, rel=0.1)


def test_large_sigma_matches_the_continuous_moments() -> None:
    sigma = 2.0**30
    y = discrete_gaussian(sigma * sigma, DRAWS).astype(np.float64) / sigma
    assert abs(y.mean()) < 0.05 and y.std() == pytest.approx(1.0, rel=0.05)
    assert stats.kstest(y, "norm").pvalue > MIN_P_VALUE


@pytest.mark.parametrize("gamma", [Fraction(0), Fraction(1, 2), Fraction(1), Fraction(5, 2), Fraction(7, 3)])
def test_bernoulli_exp_frequency(gamma: Fraction) -> None:
    num = np.full(DRAWS, gamma.numerator, dtype=object)
    den = np.full(DRAWS, gamma.denominator, dtype=object)
    hits = int(bernoulli_exp(num, den).sum())
    p = math.exp(-float(gamma))
    assert abs(hits - p * DRAWS) <= 6 * math.sqrt(DRAWS * p * (1 - p)) + 1


def test_bernoulli_exp_with_huge_integers() -> None:
    den = 3 * 2**100 + 1
    num = np.full(DRAWS, den // 2, dtype=object)  # gamma just below 1/2, in integers beyond 2^64
    hits = int(bernoulli_exp(num, np.full(DRAWS, den, dtype=object)).sum())
    p = math.exp(-0.5)
    assert abs(hits - p * DRAWS) <= 6 * math.sqrt(DRAWS * p * (1 - p))


def test_grid_mechanisms_release_only_grid_points() -> None:
    noise = SecureNoise(grid=2.0**-10)
    values = np.array([0.1, -3.3, 1e-7, 2.0 / 3.0, 123.456])
    for out in (noise.add_laplace(values, 0.5), noise.add_normal(values, 0.5)):
        steps = out / 2.0**-10
        assert np.array_equal(steps, np.round(steps)), "every output is an exact grid point"
    # values that snap to the same grid point give the same output distribution: nothing of their low
    # bits reaches the release (Mironov's attack reads exactly those)
    a = SecureNoise(grid=2.0**-10).add_laplace(np.full(DRAWS, 0.25 + 1e-9), 1.0)
    b = SecureNoise(grid=2.0**-10).add_laplace(np.full(DRAWS, 0.25 - 1e-9), 1.0)
    assert stats.ks_2samp(a, b).pvalue > MIN_P_VALUE
    assert np.all(np.round(a / 2.0**-10) == a / 2.0**-10) and np.all(np.round(b / 2.0**-10) == b / 2.0**-10)


def test_default_grid_sits_2_to_the_30_below_the_scale() -> None:
    noise = SecureNoise()
    assert noise.grid_for(1.0) == 2.0**-30
    assert noise.grid_for(0.3) == 2.0**-31  # ceil(log2 0.3) = -1
    out = noise.add_normal(np.zeros(DRAWS), 0.3)
    assert out.std() == pytest.approx(0.3, rel=0.05)
    assert np.all(np.round(out / 2.0**-31) == out / 2.0**-31)


def test_grid_sensitivity_rounds_up_and_covers_the_snapping() -> None:
    assert grid_sensitivity(1.0, 2.0**-4, 8, norm="l1") == 16 + 8
    assert grid_sensitivity(1.0, 2.0**-4, 9, norm="l2") == 16 + 3
    assert grid_sensitivity(0.1, 2.0**-4, 1, norm="l1") == math.ceil(0.1 * 16 + 1)
    with pytest.raises(ConfigError, match="norm 'linf'"):
        grid_sensitivity(1.0, 0.5, 1, norm="linf")


def test_discrete_gaussian_epsilon_is_the_rdp_bound_of_the_same_noise_multiplier() -> None:
    # Delta = 1 grid unit is 2^-30 of a clip norm of 1; sigma = 1.1 * 2^30 grid units: rho = 1 / (2 * 1.1^2)
    sigma_grid, sens_grid, delta = 1.1 * 2**30, grid_sensitivity(1.0, 2.0**-30, 1, norm="l2"), 1e-5
    rho = sens_grid**2 / (2 * sigma_grid**2)
    eps = zcdp_epsilon(rho, delta)
    rdp = Accountant("rdp").compose(GaussianRelease(sigma_grid / sens_grid)).epsilon(delta)
    pld = Accountant("pld").compose(GaussianRelease(sigma_grid / sens_grid)).epsilon(delta)
    assert pld <= eps <= rdp + 1e-3  # the conversion over a finer order grid; never below the exact PLD
    assert eps == pytest.approx(4.2395, abs=1e-3)  # stated for z = 1.1, one release, delta = 1e-5


def test_bad_parameters_name_the_value() -> None:
    with pytest.raises(ConfigError, match=r"scale -1\.0"):
        discrete_laplace(-1.0, 3)
    with pytest.raises(ConfigError, match=r"sigma\^2 nan"):
        discrete_gaussian(float("nan"), 3)
    with pytest.raises(ConfigError, match=r"grid 0\.3 must be a power of two"):
        SecureNoise(grid=0.3)
    with pytest.raises(ConfigError, match="below 2\\^56"):
        discrete_laplace(2.0**60, 3)
    with pytest.raises(ConfigError, match="size 100000000"):
        discrete_laplace(1.0, 100_000_000)


def test_fdml_release_through_the_secure_sampler() -> None:
    derivs = np.tile(np.array([[0.4, -0.2, 0.1, 0.0]]), (DRAWS // 4, 1))
    noise = SecureNoise()
    out = dp_release(derivs, mode="strict", bound_T=1.0, noise_b=0.5, rng=noise)
    grid = noise.grid_for(0.5)
    assert np.array_equal(out / grid, np.round(out / grid))
    centred = (out - derivs).ravel()
    assert abs(centred.mean()) < 0.05 and centred.var() == pytest.approx(2 * 0.5**2, rel=0.1)
    released, keep = private_derivatives(
        derivs[:100],
        np.zeros(100),
        lambda e, lab: e,
        drop_rate=0.5,
        mode="strict",
        bound_T=1.0,
        noise_b=0.5,
        rng=noise,
    )
    assert released.shape == (100, 4) and keep.dtype == np.bool_ and 20 < keep.sum() < 80


def test_secure_release_stays_within_its_metered_heap() -> None:
    derivs = np.random.default_rng(0).normal(size=(2048, 32)).astype(np.float32)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        dp_release(derivs, mode="strict", bound_T=1.0, noise_b=0.5, rng=SecureNoise())
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak <= alg2_bytes(*derivs.shape) + SECURE_NOISE_BYTES_PER_VALUE * derivs.size


def test_a_deployed_enclave_releases_grid_noise_a_simulated_one_seeded_noise() -> None:
    """Launched without ``dp_seed`` (a deployment), the enclave's FDML Alg. 2 release lies on the secure
    sampler's grid; with a seed (a simulation) it is numpy's reproducible float noise."""
    dp = {"dp_mode": "strict", "dp_bound_T": 1.0, "dp_noise_b": 0.25, "dp_drop_rate": 0.0}
    ids = [f"c{i}" for i in range(6)]
    emb = {c: np.random.default_rng(i).standard_normal((4, 8)).astype(np.float32) for i, c in enumerate(ids)}
    released = {}
    for seed in (None, 5):
        platform = SimulatedPlatform.generate()
        config = EnclaveConfig(memory_limit_bytes=8 * 2**20, dp_seed=seed, **dp)
        host = EnclaveHost.start(config, platform=platform, boundary="inprocess")
        verifier = SimulatedQuoteVerifier(platform.public_key)
        sessions = {}
        for cid in ids:
            s = EnclaveClientSession(
                cid, verifier=verifier, expected_measurement=measure_enclave(config).digest
            )
            s.establish(host.open_session(s.hello()))
            sessions[cid] = s
        result = host.loss_and_derivatives(
            1, {c: sessions[c].seal_embeddings(1, emb[c]) for c in ids}, shape=(4, 8)
        )
        assert result.rejected == {} and result.peak_bytes <= config.memory_limit_bytes
        released[seed] = np.concatenate([sessions[c].open_derivatives(1, result.derivatives[c]) for c in ids])
    grid = SecureNoise().grid_for(0.25)
    on_grid = released[None].astype(np.float64) / grid
    assert np.array_equal(on_grid, np.round(on_grid))  # float32 keeps these grid points exactly
    seeded = released[5].astype(np.float64) / grid
    assert not np.array_equal(seeded, np.round(seeded))


def test_clip_and_noise_with_secure_noise_leaves_the_seeded_generator_alone() -> None:
    transform = ClipAndNoise(clip_norm=1.0, noise_std=2.0, cohort_size=4, secure_noise=True)
    update = torch.full((DRAWS,), 1.0)
    rng = np.random.default_rng(3)
    before = rng.bit_generator.state
    noisy = transform(update, rng)
    assert rng.bit_generator.state == before  # the noise came from the CSPRNG, not the client's stream
    clipped = update / math.sqrt(DRAWS)
    noise = (noisy - clipped).double().numpy()
    assert noisy.dtype == torch.float32 and noise.std() == pytest.approx(0.5, rel=0.05)
    assert abs(noise.mean()) < 0.02


def test_polifl_central_noise_through_the_secure_sampler() -> None:
    aggregate = DPAggregate(clip_norm=1.0, noise_std=2.0, rng=SecureNoise())
    current = np.zeros(DRAWS, dtype=np.float32)
    results = {f"d{i}": FitResult(current + np.float32(0.001 * i), 1) for i in range(4)}
    new = aggregate(1, results, current)
    noise = new.astype(np.float64) - np.mean([0.001 * i for i in range(4)])
    assert new.dtype == np.float32 and noise.std() == pytest.approx(2.0 / 4, rel=0.05)


def test_networked_policy_devices_draw_their_shares_securely() -> None:
    x = np.zeros((4, 3), dtype=np.float32)
    pool = device_pool("images", {"p1": {"x": x, "y": np.zeros(4, dtype=np.int64)}}, {"p1": "!0"})
    assert pool.secure_noise is True


def test_discrete_laplace_beyond_int64_scales() -> None:
    scale = float(2**55) + 2.0**10  # integers past 2^53 run as exact Python ints
    y = discrete_laplace(scale, 4000).astype(np.float64) / scale
    assert abs(np.abs(y).mean() - 1.0) < 0.15 and abs(y.mean()) < 0.15
