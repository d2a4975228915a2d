"""Batching, max_unavailable waves and stop rules of tools/rollout (gpufleet/rollout/plan.py)."""
import pytest

from gpufleet.rollout import plan

HOSTS = [f"h{i}" for i in range(1, 9)]


def test_canary_first_then_batches_by_size():
    batches = plan.make_batches(HOSTS[:6], canary=1, size=3)
    assert [(b.name, b.hosts) for b in batches] == [
        ("canary", ("h1",)), ("batch 1", ("h2", "h3", "h4")), ("batch 2", ("h5", "h6"))]


def test_no_canary():
    assert [b.hosts for b in plan.make_batches(HOSTS[:3], canary=0, size=2)] == [("h1", "h2"), ("h3",)]
    assert plan.make_batches(HOSTS[:3], canary=0, size=2)[0].index == 1


def test_batch_percent_rounds_up_and_is_at_least_one():
    assert plan.batch_size_for(8, None, 25, default=1) == 2
    assert plan.batch_size_for(6, None, 50, default=1) == 3
    assert plan.batch_size_for(3, None, 10, default=1) == 1
    assert plan.batch_size_for(8, None, None, default=4) == 4
    with pytest.raises(plan.PlanError):
        plan.batch_size_for(8, 2, 25, default=1)
    with pytest.raises(plan.PlanError):
        plan.batch_size_for(8, None, 0, default=1)


@pytest.mark.parametrize("value,total,expect", [("0", 6, 0), ("2", 6, 2), ("25%", 8, 2), ("10%", 6, 0), ("100%", 6, 6), (3, 6, 3)])
def test_max_fail_count_or_percent(value, total, expect):
    assert plan.parse_max_fail(value, total) == expect


@pytest.mark.parametrize("bad", ["x", "-1", "150%", "1.5"])
def test_max_fail_rejects_nonsense(bad):
    with pytest.raises(plan.PlanError):
        plan.parse_max_fail(bad, 6)


def test_waves_never_exceed_max_unavailable():
    # 2 may be out; one host is already out (failed after its upgrade): one more may start
    assert plan.waves(["h2", "h3", "h4"], max_unavailable=2, unavailable=1) == ["h2"]
    assert plan.waves(["h2", "h3", "h4"], max_unavailable=3, unavailable=0) == ["h2", "h3", "h4"]
    assert plan.waves(["h2", "h3"], max_unavailable=2, unavailable=2) == []
    assert plan.room(1, 5) == 0


def test_canary_failure_always_stops():
    canary = plan.Batch(0, ("h1",))
    assert "canary" in plan.stop_reason(canary, ["h1"], failed_total=1, max_fail=5)
    assert plan.stop_reason(canary, [], failed_total=0, max_fail=0) is None


def test_batch_failure_stops_only_beyond_max_fail():
    batch = plan.Batch(1, ("h2", "h3", "h4"))
    assert plan.stop_reason(batch, ["h2"], failed_total=1, max_fail=1) is None
    assert "more than --max-fail 1" in plan.stop_reason(batch, ["h2", "h3"], failed_total=2, max_fail=1)
