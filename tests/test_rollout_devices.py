"""One CUDA device per rollout replica of a process (laminar.rl.model.DeviceSlots; pure, no GPU needed)."""

import threading

import pytest

from laminar.rl.model import DeviceSlots


def test_each_replica_gets_its_own_device_while_there_are_enough() -> None:
    slots = DeviceSlots()
    # a worker Ray placed with 3 GPUs (CUDA_VISIBLE_DEVICES lists 3) runs 3 replicas: cuda:0, cuda:1, cuda:2
    assert [slots.acquire(3) for _ in range(3)] == [0, 1, 2]
    # a 4th shares the least used device, the lowest index first: 0 (each has one replica)
    assert slots.acquire(3) == 0
    # replica on 1 ends; the next replica takes 1, now the least used (0 has two, 2 has one, 1 none)
    slots.release(1)
    assert slots.acquire(3) == 1


def test_a_released_device_is_reused_and_a_process_without_one_is_refused() -> None:
    slots = DeviceSlots()
    assert slots.acquire(1) == 0 and slots.acquire(1) == 0  # one GPU, two replicas: both on cuda:0
    slots.release(0)
    slots.release(0)
    assert slots.acquire(2) == 0
    with pytest.raises(ValueError, match="devices=0"):
        slots.acquire(0)


def test_concurrent_replicas_spread_evenly() -> None:
    slots, got = DeviceSlots(), []
    threads = [threading.Thread(target=lambda: got.append(slots.acquire(4))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [0, 0, 1, 1, 2, 2, 3, 3]  # 8 replicas on 4 devices: two each, none lost to a race
