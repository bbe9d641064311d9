"""GPUs the planner knows by name (bigfit/machine/gpus.py): `--gpus 8xH100` gives their memory and rates, a
machine's own GPUs are rated by torch's device name, the slowest of a mix rates the node, an unknown
GPU keeps the H200's rates with a note, and a name that is neither a size nor a GPU is refused."""
from __future__ import annotations

import pytest
import torch

from bigfit.errors import BigfitError
from bigfit.machine import gpus
from bigfit.machine.hardware import DEFAULTS, Hardware, detect, gpu_rates, parse_gpus


def test_names_give_memory_and_rates_scaled_as_the_h200_was_fitted():
    assert parse_gpus("2xH100") == [int(79.6 * 2**30)] * 2
    h100 = gpu_rates("8xH100")
    assert h100 == {"gpu_tflops": pytest.approx(DEFAULTS["gpu_tflops"]), "gpu_mem_gbps": 3350.0}
    assert gpu_rates("1xH200") == {"gpu_tflops": pytest.approx(DEFAULTS["gpu_tflops"]),
                                   "gpu_mem_gbps": DEFAULTS["gpu_mem_gbps"]}
    assert gpu_rates("h100,L4")["gpu_tflops"] == pytest.approx(DEFAULTS["gpu_tflops"] * 121 / 989)  # the slowest
    assert gpu_rates("8x16GB") == {}  # sizes alone: the defaults stay
    assert parse_gpus("H100,24GB") == [int(79.6 * 2**30), 24 * 10**9]


@pytest.mark.parametrize("device_name, expected", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100-PCIE"), ("NVIDIA H100 NVL", "H100-NVL"),
    ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"), ("NVIDIA GeForce RTX 4090", "RTX4090"), ("Tesla T4", None)])
def test_torchs_device_names_find_their_entry(device_name, expected):
    found = gpus.by_device_name(device_name)
    assert (found.name if found else None) == expected


def test_a_machines_gpus_are_rated_by_name_and_an_unknown_one_as_an_h200(monkeypatch):
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 85 * 10**9}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    hw = detect()
    assert (hw.gpu_mem_gbps, hw.gpu_bytes) == (3350.0, (85 * 10**9,) * 2)
    assert any("H100 80GB HBM3: rated 760 TFLOP/s" in n for n in hw.notes)
    names[1] = "Tesla T4"
    hw = detect()
    assert hw.gpu_mem_gbps == Hardware(gpu_bytes=(1,)).gpu_mem_gbps
    assert any("Tesla T4: not in bigfit's table" in n for n in hw.notes)


@pytest.mark.parametrize("spec, message", [
    ("2xH10", "'H10' is neither a size (16GB) nor a GPU bigfit knows (H200, H100-NVL"),
    ("0xH100", "write a list like 8x16GB")])
def test_a_gpu_spec_that_names_nothing_known_is_refused_in_one_line(spec, message):
    with pytest.raises(BigfitError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_gpus(spec)


def test_the_plan_says_how_each_gpu_is_rated():
    assert Hardware(gpu_bytes=(24 * 10**9,)).describe().endswith("each GPU rated as an H200 760 TFLOP/s and 4800 GB/s")
    h100 = Hardware(gpu_bytes=tuple(parse_gpus("H100")), **gpu_rates("H100"))
    assert h100.describe().endswith("each GPU rated 760 TFLOP/s and 3350 GB/s")
