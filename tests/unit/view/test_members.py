"""Each request partition's state: the latest word of the instance the group assigns it."""

from __future__ import annotations

from kdelay.protocol.status import RESTORING, SERVING, InstanceStatus, PartitionStatus
from kdelay.view.members import Member, PartitionState, partition_states


def test_each_partition_takes_the_state_its_assigned_instance_said() -> None:
    members = [Member("a", "kdelay", "/h1", [0, 1]), Member("b", "kdelay", "/h2", [2])]
    said = {"a": InstanceStatus("a", 5_000, {0: PartitionStatus(SERVING),
                                             1: PartitionStatus(RESTORING, 30, 120)}),
            # b's old word claims 0 and 1 too: only what the group assigns b counts
            "b": InstanceStatus("b", 4_000, {0: PartitionStatus(RESTORING, 1, 2),
                                             2: PartitionStatus(RESTORING)})}
    states = partition_states(members, said, 4)
    assert states[0] == PartitionState(SERVING, 0, None, "a", 5_000)
    assert states[1] == PartitionState(RESTORING, 30, 120, "a", 5_000)
    assert states[1].percent == 25.0
    assert states[2] == PartitionState(RESTORING, 0, None, "b", 4_000)
    assert states[2].percent is None
    assert states[3].state == "unknown"
    assert states[3].why == "no instance is assigned it"


def test_without_a_word_a_partition_is_unknown_and_says_why() -> None:
    members = [Member("a", "kdelay", "/h1", [0, 1])]
    said = {"a": InstanceStatus("a", 5_000, {0: PartitionStatus(SERVING)})}
    assert partition_states(members, said, 2)[1].why == "a's status does not name it yet"
    assert partition_states(members, {}, 2)[0].why == "a has not said yet"
    missing = partition_states(members, {}, 2, "the status topic kdelay.status does not exist")
    assert {s.state for s in missing.values()} == {"unknown"}
    assert missing[0].why == "the status topic kdelay.status does not exist"
