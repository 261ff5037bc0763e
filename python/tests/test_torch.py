"""torch tensors through DLPack: CPU always (when torch is installed), CUDA where a GPU is.
torch is not a test dependency: without it these are skipped."""

import pytest

import xfer
from conftest import MOCK

torch = pytest.importorskip("torch")


def roundtrip(engine, device):
    src = torch.arange(1 << 16, dtype=torch.int32, device=device)
    dst = torch.zeros(1 << 16, dtype=torch.int32, device=device)
    s = engine.reg_mr(src, access="local")
    d = engine.reg_mr(dst)
    assert s.nbytes == src.numel() * 4 and d.device == ("cpu" if device == "cpu" else f"cuda:{dst.device.index or 0}")
    engine.submit_single_write(s, d.desc, imm=1).wait(10)
    engine.expect_imm_count(1, engine.expected_arrivals(s.nbytes)).wait(10)
    assert torch.equal(src, dst)


def test_cpu_tensors():
    with xfer.TransferEngine(MOCK) as e:
        roundtrip(e, "cpu")
        with pytest.raises(xfer.InvalidArgumentError, match="contiguous"):
            e.reg_mr(torch.zeros(64, 64)[:, ::2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors():
    with xfer.TransferEngine(MOCK) as e:
        roundtrip(e, "cuda")
