"""How a rank picks its GPU from Slurm's variables, and how a cell's resources are checked against
its spec (cell/ranks/devices.py, resources.py; docs/clusters.md "Which GPU a rank uses")."""

from __future__ import annotations

from hpcfsdp.cell.ranks.devices import DeviceChoice, choose_device
from hpcfsdp.cell.ranks.resources import Seen, resource_problems


def test_each_task_of_a_slurm_step_takes_its_local_ids_entry_of_the_gpus_slurm_made_visible():
    step = {"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "2,3", "SLURM_STEP_GPUS": "2,3"}
    choice = choose_device(step)
    assert (choice.index, choice.visible, choice.gpu) == (1, 2, "3")  # torch numbers the visible GPUs from 0


def test_torchruns_local_rank_wins_over_slurms_local_id():
    assert choose_device({"LOCAL_RANK": "0", "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1"}).index == 0


def test_a_task_bound_to_one_gpu_uses_cuda_0_whatever_its_local_id():
    """--gpus-per-task=1 or --gpu-bind: each task's CUDA_VISIBLE_DEVICES lists its own GPU only."""
    choice = choose_device({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "GPU-bbbb"})
    assert (choice.index, choice.visible, choice.gpu) == (0, 1, "GPU-bbbb")


def test_two_tasks_given_one_gpu_both_land_on_it_and_say_so():
    """An SBATCH_GRES=gpu:1 in the submitting shell gives a two-task node one GPU."""
    choices = [choose_device({"SLURM_LOCALID": str(i), "CUDA_VISIBLE_DEVICES": "0"}) for i in (0, 1)]
    assert [(c.index, c.visible, c.gpu) for c in choices] == [(0, 1, "0"), (0, 1, "0")]


def test_without_cuda_visible_devices_a_task_takes_the_node_numbered_gpu_slurm_names():
    choice = choose_device({"SLURM_LOCALID": "1", "SLURM_STEP_GPUS": "4,6", "SLURM_JOB_GPUS": "4,5,6,7"})
    assert (choice.index, choice.visible, choice.gpu, choice.source) == (6, 2, "6", "SLURM_STEP_GPUS")
    job = choose_device({"SLURM_LOCALID": "0", "SLURM_JOB_GPUS": "5,7"})
    assert (job.index, job.visible, job.source) == (5, 2, "SLURM_JOB_GPUS")


def test_no_gpu_variables_means_cuda_local_rank_of_every_gpu_of_the_node():
    assert choose_device({"LOCAL_RANK": "3"}) == DeviceChoice(3, None, None, (), "LOCAL_RANK")
    assert choose_device({}) == DeviceChoice(0, None, None, (), "LOCAL_RANK")


def test_a_task_slurm_gave_no_gpu_sees_none():
    for empty in ("", "NoDevFiles"):
        choice = choose_device({"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": empty})
        assert (choice.visible, choice.gpu) == (0, None)


def seen(rank: int, host: str, visible: tuple[str, ...] = (), gpu: str | None = None, bus: str | None = None) -> Seen:
    entry = {"rank": rank, "host": host, "pid": 100 + rank, "device": "cpu", "gpu_uuid": gpu, "gpu_bus_id": bus}
    return Seen(entry, visible, gpu or (visible[rank % len(visible)] if visible else None))  # type: ignore[arg-type]


def test_resources_as_asked_have_no_problems():
    ranks = [seen(0, "n1", ("0", "1")), seen(1, "n1", ("0", "1")), seen(2, "n2", ("0", "1")), seen(3, "n2", ("0", "1"))]
    assert resource_problems(ranks, nodes=2, gpus_per_node=2, device_type="cpu") == []
    assert resource_problems([seen(0, "vm"), seen(1, "vm")], nodes=1, gpus_per_node=2, device_type="cpu") == []


def test_fewer_gpus_than_asked_ranks_on_one_gpu_and_fewer_hosts_are_each_a_sentence():
    one_gpu = [seen(0, "n1", ("0",)), seen(1, "n1", ("0",))]
    assert resource_problems(one_gpu, nodes=2, gpus_per_node=2, device_type="cpu") == [
        "2 nodes asked, the ranks ran on 1 (n1)",
        "2 GPUs per node asked, 1 visible on n1",
        "ranks 0 and 1 share GPU 0 on n1",
    ]
    shared = [seen(r, "n1", gpu="GPU-1234", bus="00000000:1A:00.0") for r in range(3)]
    assert resource_problems(shared, nodes=1, gpus_per_node=3, device_type="cuda") == [
        "3 GPUs per node asked, 1 visible on n1",
        "ranks 0, 1 and 2 share GPU GPU-1234 (bus 00000000:1A:00.0) on n1",
    ]
