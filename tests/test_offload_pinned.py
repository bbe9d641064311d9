"""The offload engine's exactly-sized pinned buffers (offload/pinned.py). CUDA's registration
itself is faked here (this machine has no GPU; benchmarks/pinned_rounding.py checks the real one):
what is checked is what bigfit decides, namely which pages are registered and when they are released."""
import gc

import pytest
import torch

from bigfit.offload import pinned


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = {"registered": {}, "unregistered": []}

    def register(ptr, nbytes):
        calls["registered"][ptr] = nbytes
        return None

    monkeypatch.setattr(pinned, "_register", register)
    monkeypatch.setattr(pinned, "_unregister", calls["unregistered"].append)
    return calls


@pytest.mark.parametrize("n, dtype", [(1, torch.float32), (100_003, torch.bfloat16), (3 << 20, torch.float32)])
def test_exact_size_on_whole_pages_of_its_own(fake_cuda, n, dtype):
    t = pinned.host_zeros(n, dtype, pin=True)
    assert t.shape == (n,) and t.dtype == dtype and bool((t == 0).all())
    [(ptr, nbytes)] = fake_cuda["registered"].items()
    assert ptr == t.data_ptr() and ptr % pinned.PAGE == 0  # starts a page: no page shared with other data
    assert nbytes % pinned.PAGE == 0 and 0 <= nbytes - n * dtype.itemsize < pinned.PAGE  # no power-of-two rounding
    storage = t.untyped_storage()
    assert storage.data_ptr() <= ptr and ptr + nbytes <= storage.data_ptr() + storage.nbytes()


def test_unregistered_when_the_last_view_goes(fake_cuda):
    t = pinned.host_zeros(5000, pin=True)
    ptr = t.data_ptr()
    view = t[10:20]
    del t
    gc.collect()
    assert fake_cuda["unregistered"] == []  # a view still uses the memory
    del view
    gc.collect()
    assert fake_cuda["unregistered"] == [ptr]


def test_a_failed_registration_says_so(monkeypatch):
    monkeypatch.setattr(pinned, "_register", lambda ptr, nbytes: "out of memory")
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 4 MiB .*out of memory.*BIGFIT_PINNED=torch"):
        pinned.host_zeros(1 << 20, pin=True)


def test_unpinned_is_plain_zeros(fake_cuda):
    t = pinned.host_zeros(7, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.tolist() == [0] * 7 and fake_cuda["registered"] == {}
