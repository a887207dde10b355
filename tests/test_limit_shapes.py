"""Generated backend shapes (loadtest/sim/shapes.py): determinism, validity, the coverage the
generator claims, disjoint splits."""

from __future__ import annotations

import pytest

from loadtest.sim import shapes
from loadtest.sim.profiles import Profile, load_profile
from loadtest.sim.shapes import Shape, estimate, generate_shape, split_seeds

N = 300  # shapes the coverage claims are checked on


@pytest.fixture(scope="module")
def many() -> list[Shape]:
    return [generate_shape(seed) for seed in range(N)]


def _engine(shape: Shape) -> dict:
    """A shape's profile without its name and description (which embed the seed)."""
    return shape.profile.model_dump(exclude={"name", "description", "model_name"})


# --- the generator ------------------------------------------------------------------------------


def test_a_seed_always_gives_the_same_shape_and_seeds_differ():
    assert generate_shape(7) == generate_shape(7)
    assert generate_shape(7).profile.model_dump() == generate_shape(7).profile.model_dump()
    assert _engine(generate_shape(7)) != _engine(generate_shape(8))


def test_shapes_are_valid_profiles_with_a_workload_that_fits(many):
    names = set()
    for sh in many:
        p = sh.profile
        assert Profile.model_validate(p.model_dump()) == p
        lo, hi = sh.output_len
        assert 1 <= lo < hi and sh.input_len >= 1
        assert p.context_length >= sh.input_len + hi
        assert p.max_total_tokens >= sh.input_len + hi + 1  # a lone request never aborts
        assert sh.est == estimate(p, sh.input_len, sh.output_len)
        assert 1 <= sh.est.capacity <= p.max_running_requests
        assert sh.name.startswith(f"s{sh.seed}-")
        names.add(sh.name)
    assert len(names) == len(many)


def test_shapes_stay_in_the_realistic_and_affordable_bands(many):
    for sh in many:
        e = sh.est
        assert shapes.SINGLE_ITL_MS[0] <= e.single_itl_s * 1000 <= shapes.SINGLE_ITL_MS[1]
        assert e.tokens_per_s <= shapes.MAX_TOKENS_PER_S
        assert e.loaded_itl_s <= shapes.MAX_LOADED_ITL_S
        assert e.capacity * sum(sh.output_len) / 2 <= shapes.MAX_TOKENS_IN_FLIGHT
        p = sh.profile
        assert shapes.PREFILL_MS_PER_TOKEN[0] <= p.prefill_ms_per_token
        assert p.prefill_ms_per_token <= shapes.PREFILL_MS_PER_TOKEN[1]


def test_shapes_cover_the_claimed_ranges(many):
    kinds = {sh.profile.parallelism for sh in many}
    assert kinds == {"pp", "tp", "ep"}
    stages = [sh.profile.stages for sh in many]
    assert min(stages) == 1 and max(stages) == 16
    assert min(sh.profile.pp_size for sh in many if sh.profile.parallelism == "pp") == 2
    caps = [sh.profile.max_running_requests for sh in many]
    assert min(caps) >= 8 and max(caps) <= 1024
    assert min(caps) <= 12 and max(caps) >= 700
    ratios = [sh.est.cost_ratio for sh in many]
    assert min(ratios) <= 0.15 and max(ratios) >= 7  # fixed-cost to per-request: 2 decades
    itls = [sh.est.single_itl_s * 1000 for sh in many]
    assert min(itls) < 8 and max(itls) > 80
    kv_bound = sum(sh.est.kv_bound for sh in many)
    assert 0.3 * N <= kv_bound <= 0.7 * N  # the pool binds first on some, the cap on others
    assert sum(sh.est.binding == "cap" for sh in many) >= 0.3 * N
    assert any(sh.est.binding == "prefill" for sh in many)
    heavy = sum(sh.est.prefill_fraction > shapes.HEAVY_PREFILL_ABOVE for sh in many)
    light = sum(sh.est.prefill_fraction < shapes.LIGHT_PREFILL_BELOW for sh in many)
    assert heavy >= 0.1 * N and light >= 0.1 * N
    means = [sum(sh.output_len) / 2 for sh in many]
    assert min(means) < 32 and max(means) > 512
    prompts = [sh.input_len for sh in many]
    assert min(prompts) < 64 and max(prompts) > 4096
    noise = [sh.profile.step_noise for sh in many]
    assert 0.1 * N <= noise.count(0.0) <= 0.5 * N and max(noise) > 0.2
    assert {sh.profile.new_token_ratio for sh in many} == set(shapes.NEW_TOKEN_RATIOS)
    assert any(sh.profile.expert_read_ms > 0 for sh in many)
    assert any(sh.profile.expert_read_ms == 0 for sh in many)
    assert any(sh.profile.dp_size > 1 for sh in many)


def test_tune_and_accept_splits_are_disjoint():
    tune, accept = split_seeds("tune"), split_seeds("accept")
    assert (len(tune), len(accept)) == (60, 200)
    assert not set(tune) & set(accept)
    assert not {str(_engine(generate_shape(s))) for s in tune} & {
        str(_engine(generate_shape(s))) for s in accept
    }
    with pytest.raises(ValueError):  # a tune run can never reach into the accept seeds
        split_seeds("tune", 20, shapes.SPLITS["accept"].start - 10)
    with pytest.raises(ValueError):
        split_seeds("accept", 5, 0)


def test_estimate_matches_the_calibrated_profiles():
    pp8 = estimate(load_profile("pp8"), 1024, (512, 512))
    assert pp8.capacity == 64 and pp8.binding == "cap"
    assert pp8.single_itl_s == pytest.approx(1 / 24.7, rel=0.01)  # calibrated 1/TPOT at C=1
    assert pp8.tokens_per_s == pytest.approx(733, rel=0.03)  # calibrated aggregate at the knee
    tp8 = estimate(load_profile("tp8"), 1024, (512, 512))
    assert tp8.capacity == 128 and tp8.tokens_per_s == pytest.approx(1569, rel=0.03)
    small_pool = load_profile("tp8").with_overrides(max_total_tokens=20_000)
    assert estimate(small_pool, 1024, (512, 512)).binding == "kv"
    short = estimate(load_profile("tp8"), 8000, (8, 8))  # 1 prompt per pass, 8 passes each
    assert short.binding == "prefill" and short.capacity < 128
