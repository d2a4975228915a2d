"""Slurm drain/resume: the SlurmNode fact (sinfo's state and reason) and the decisions of
operations/drain.slurm_node; the e2e side runs against real Slurm (tests/e2e/test_rollout_slurm.py)."""
import pytest
from pyinfra.context import ctx_host

from gpufleet.facts.slurm import SlurmNode, SlurmNodeData
from gpufleet.operations.drain import slurm_node, slurm_node_drained

pytestmark = pytest.mark.unit
SCONTROL = "/usr/bin/scontrol"


class FakeHost:
    def __init__(self, node: SlurmNodeData):
        self.node, self.noops, self.asked = node, [], []

    def get_fact(self, cls, *args, **kwargs):
        assert cls is SlurmNode
        self.asked.append(kwargs)
        return self.node

    def noop(self, description):
        self.noops.append(description)


def _plan(op, data, **kwargs):
    fake = FakeHost(data)
    with ctx_host.use(fake):
        commands = [str(c.get_raw_value()) for c in op._inner(**kwargs)]
    return commands, fake


def test_fact_reads_state_and_reason():
    data = SlurmNode().process(["node gpu-a01", f"scontrol {SCONTROL}",
                                "state drained|admin: bad DIMM | ticket 42"])
    assert data.state == "drained" and data.reason == "admin: bad DIMM | ticket 42"
    assert data.drain_set and data.drained and not data.ours
    data = SlurmNode().process(["node gpu-a01", f"scontrol {SCONTROL}", "state draining|gpufleet driver upgrade to 1"])
    assert data.drain_set and not data.drained and data.ours
    data = SlurmNode().process(["node gpu-a01", f"scontrol {SCONTROL}", "error node gpu-a01 is not in the Slurm cluster"])
    assert data.state is None and "not in the Slurm cluster" in data.error
    assert SlurmNode().process(["node gpu-a01"]).scontrol is None


def test_fact_node_name_is_checked_and_quoted():
    assert SlurmNode().command("gpu-a01.rack3").startswith("node=gpu-a01.rack3\n")
    assert SlurmNode().command("").startswith("node=''\n")
    with pytest.raises(ValueError):
        SlurmNode().command("a;reboot")


def test_drain_sets_the_gpufleet_reason_on_the_named_node():
    cmds, fake = _plan(slurm_node, SlurmNodeData(SCONTROL, "n7", "mixed"), drained=True,
                       reason="gpufleet driver upgrade to 580.126.09", node="n7")
    assert cmds == [f"{SCONTROL} update nodename=n7 state=drain 'reason=gpufleet driver upgrade to 580.126.09'"]
    assert fake.asked == [{"node": "n7"}]


def test_a_node_drained_by_someone_else_is_neither_redrained_nor_resumed():
    admin = SlurmNodeData(SCONTROL, "n7", "drained", "admin: bad DIMM")
    cmds, fake = _plan(slurm_node, admin, drained=True, reason="gpufleet driver upgrade to 1")
    assert cmds == [] and "drained already" in fake.noops[0]
    cmds, fake = _plan(slurm_node, admin, drained=False)
    assert cmds == [] and "drained by someone else" in fake.noops[0]


def test_resume_only_what_gpufleet_drained():
    cmds, _ = _plan(slurm_node, SlurmNodeData(SCONTROL, "n7", "drained", "gpufleet driver upgrade to 1"), drained=False)
    assert cmds == [f"{SCONTROL} update nodename=n7 state=resume"]
    cmds, fake = _plan(slurm_node, SlurmNodeData(SCONTROL, "n7", "idle"), drained=False)
    assert cmds == [] and "not drained" in fake.noops[0]


def test_drain_reason_must_carry_the_tag():
    with pytest.raises(ValueError):
        _plan(slurm_node, SlurmNodeData(SCONTROL, "n7", "idle"), drained=True, reason="maintenance")


def test_wait_for_drained_passes_node_and_timeout_as_arguments():
    cmds, _ = _plan(slurm_node_drained, SlurmNodeData(SCONTROL, "n7", "draining", "gpufleet x"), node="n7", timeout=90)
    assert cmds[0].startswith("sh -c '") and cmds[0].endswith("' wait-drained n7 90")
    cmds, fake = _plan(slurm_node_drained, SlurmNodeData(None, "n7"), node="n7")
    assert cmds == [] and fake.noops
