"""operations/holds.held: yields apt-mark only for packages whose hold state differs."""
import pytest
from pyinfra.context import ctx_host

from gpufleet.facts.packages import HeldPackages
from gpufleet.operations.holds import held

pytestmark = pytest.mark.unit


class FakeHost:
    def __init__(self, holds):
        self.holds, self.noops = list(holds), []

    def get_fact(self, cls, *args, **kwargs):
        assert cls is HeldPackages
        return self.holds

    def noop(self, description):
        self.noops.append(description)


def _plan(current_holds, **kwargs):
    fake = FakeHost(current_holds)
    with ctx_host.use(fake):
        commands = [str(c) for c in held._inner(**kwargs)]
    return commands, fake.noops


def test_holds_only_what_is_missing():
    assert _plan(["a"], packages=["a", "b", "c"]) == (["apt-mark hold b c"], [])


def test_nothing_to_do_yields_nothing_and_says_so():
    commands, noops = _plan(["a", "b"], packages=["a", "b"])
    assert commands == [] and noops == ["held already: a, b"]


def test_unhold_only_what_is_held():
    assert _plan(["a", "x"], packages=["a", "b"], present=False)[0] == ["apt-mark unhold a"]


def test_names_are_quoted():
    assert _plan([], packages=["x; rm -rf /"])[0] == ["apt-mark hold 'x; rm -rf /'"]
