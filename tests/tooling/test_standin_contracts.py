"""The CPU stand-ins hold the real ops' contracts: the values they compute follow
from the kernels' documented semantics, and arguments a kernel would reject
raise instead of being truncated or ignored."""

from __future__ import annotations

import types

import pytest
import torch

from standins import cpu_kvcacheio_standin as kvcacheio
from standins import dsa
from standins.cpu_server_standins import KernelStandIn


def test_kernel_standin_is_not_truthy_and_raises_when_called():
    stub = KernelStandIn("sgl_kernel.fused_op")
    assert not stub  # ``if sgl_kernel.X:``: not available
    with pytest.raises(NotImplementedError, match="sgl_kernel.fused_op"):
        stub()


def test_kvcacheio_requires_equal_index_counts():
    host = torch.zeros(4, 2, 1, 8)  # page-first: pages, layers, page, width
    dev = [torch.zeros(8, 8)]
    with pytest.raises(ValueError, match="equal counts"):
        kvcacheio.transfer_kv_per_layer_direct_pf_lf(
            [host], dev, torch.arange(3), torch.arange(2), 0, 1
        )
    with pytest.raises(ValueError, match="equal counts"):
        kvcacheio.transfer_kv_all_layer_direct_lf_pf(
            [torch.zeros(8, 8), torch.zeros(8, 8)],
            [host],
            torch.arange(2),
            torch.arange(3),
            1,
        )


def test_kvcacheio_moves_whole_pages_between_the_layouts():
    """The page_first_direct ops on a hand-computed example: device buffers
    are layer-first (one [tokens, width] tensor per layer), the host buffer is
    page-first ([pages, layers, page_size, width]); indices are token
    indices, one page per ``page_size`` of them."""
    ps, width = 2, 3
    # layer l, token t, column c holds 100 * l + 3 * t + c
    dev = [
        torch.arange(8 * width, dtype=torch.float32).view(8, width) + 100 * l
        for l in range(2)
    ]
    host = torch.zeros(4, 2, ps, width)
    # device pages 3 and 1 (tokens 6,7 and 2,3) -> host pages 1 and 3
    kvcacheio.transfer_kv_all_layer_direct_lf_pf(
        dev, [host], torch.tensor([6, 7, 2, 3]), torch.tensor([2, 3, 6, 7]), ps
    )
    assert host[1, 0].tolist() == [[18.0, 19.0, 20.0], [21.0, 22.0, 23.0]]
    assert host[1, 1].tolist() == [[118.0, 119.0, 120.0], [121.0, 122.0, 123.0]]
    assert host[3, 0].tolist() == [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]
    assert host[3, 1].tolist() == [[106.0, 107.0, 108.0], [109.0, 110.0, 111.0]]
    assert not host[0].any() and not host[2].any()
    # host page 3, layer 1 -> page 0 of layer 1's device buffer (the op gets
    # that layer's buffer, as upstream's load_to_device_per_layer passes it)
    back = torch.zeros(8, width)
    kvcacheio.transfer_kv_per_layer_direct_pf_lf(
        [host], [back], torch.tensor([6, 7]), torch.tensor([0, 1]), 1, ps
    )
    assert back[:2].tolist() == [[106.0, 107.0, 108.0], [109.0, 110.0, 111.0]]
    assert not back[2:].any()


def test_gpu_standin_requires_equal_page_counts():
    from tooling.test_gpu_standin import GPU, load_module

    page_runs = load_module("sgl_kernel.page_runs", GPU / "page_runs.py")
    with pytest.raises(ValueError, match="equal counts"):
        page_runs.find_runs(torch.arange(3), torch.arange(2), 1, 1)


def test_set_k_and_s_writes_the_kernel_page_layout():
    ps = 64
    pool = types.SimpleNamespace(index_page_size=ps)
    buf = torch.zeros(3, ps * (128 + 4), dtype=torch.uint8)
    loc = torch.tensor([0, 65, 191], dtype=torch.int64)
    k = torch.randint(0, 120, (3, 128), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5], [2.0], [0.125]], dtype=torch.float32)
    dsa.set_k_and_s(None, pool, buf, loc, k, scale)
    flat = buf.view(-1)
    row = ps * 132
    for t, slot in enumerate(loc.tolist()):
        page, off = divmod(slot, ps)
        key = flat[page * row + off * 128 : page * row + off * 128 + 128]
        assert torch.equal(key, k[t].view(torch.uint8))
        s_at = page * row + ps * 128 + off * 4
        assert flat[s_at : s_at + 4].view(torch.float32).item() == scale[t].item()
    assert int((buf != 0).sum()) <= 3 * (128 + 4)  # nothing else written


@pytest.mark.parametrize(
    "change",
    [
        dict(loc=torch.tensor([0, 1])),  # counts differ
        dict(k=torch.zeros(3, 64, dtype=torch.float8_e4m3fn)),  # head dim != 128
        dict(scale=torch.ones(3, 1, dtype=torch.bfloat16)),  # scale not fp32
        dict(buf=torch.zeros(3, 64 * 128, dtype=torch.uint8)),  # no scale area
    ],
)
def test_set_k_and_s_refuses_what_the_kernel_asserts(change):
    args = dict(
        buf=torch.zeros(3, 64 * 132, dtype=torch.uint8),
        loc=torch.tensor([0, 1, 2]),
        k=torch.zeros(3, 128, dtype=torch.float8_e4m3fn),
        scale=torch.ones(3, 1),
    )
    args.update(change)
    pool = types.SimpleNamespace(index_page_size=64)
    with pytest.raises(ValueError, match="contract"):
        dsa.set_k_and_s(None, pool, args["buf"], args["loc"], args["k"], args["scale"])


def test_act_quant_block_scales_as_the_triton_kernel():
    # one block of 3.0 and one of -0.5: amax / 448, rounded up to a power of two
    x = torch.cat([torch.full((1, 128), 3.0), torch.full((1, 128), -0.5)], 1)
    y, s = dsa.act_quant(x.to(torch.bfloat16), 128, "ue8m0")
    assert s.tolist() == [[2.0**-7, 2.0**-9]]  # 3/448 -> 2^-7, 0.5/448 -> 2^-9
    assert y.float()[0, :128].unique().tolist() == [384.0]  # 3 * 2^7
    assert y.float()[0, 128:].unique().tolist() == [-256.0]  # -0.5 * 2^9
    y, s = dsa.act_quant(x, 128, None)  # no rounding: scale = amax / 448
    assert s[0, 0].item() == pytest.approx(3.0 / 448)
    with pytest.raises(ValueError, match="blocks of 128"):
        dsa.act_quant(torch.zeros(2, 100), 128)


def test_hadamard_is_orthonormal_and_sylvester_ordered():
    x = torch.randn(5, 128)
    twice = dsa.rotate_activation(dsa.rotate_activation(x))
    torch.testing.assert_close(twice, x, rtol=1e-4, atol=1e-4)
    e0 = torch.zeros(1, 4)
    e0[0, 1] = 1.0
    # row 1 of the 4x4 Sylvester matrix: + - + -
    assert dsa.hadamard_transform(e0).tolist() == [[1.0, -1.0, 1.0, -1.0]]


def test_indexer_standin_raises_past_index_topk():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    indexer = types.SimpleNamespace(index_topk=4, use_dsa_indexer_fusion=False)
    batch = types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        seq_lens_cpu=torch.tensor([3, 5]),
        seq_lens=torch.tensor([3, 5]),
    )
    with pytest.raises(NotImplementedError, match="exceeds index_topk=4"):
        dsa.indexer_forward_native(indexer, None, None, None, batch, 0)
    # Without the CPU copy (decode, or a batch that carries none) the device
    # lengths decide, as in the real indexer's skip.
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        batch.forward_mode, batch.seq_lens_cpu = mode, None
        with pytest.raises(NotImplementedError, match="exceeds index_topk=4"):
            dsa.indexer_forward_native(indexer, None, None, None, batch, 0)
    # No lengths at all: the real indexer would select, the stand-in cannot.
    batch.seq_lens = torch.tensor([], dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="no sequence lengths"):
        dsa.indexer_forward_native(indexer, None, None, None, batch, 0)
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    with pytest.raises(NotImplementedError, match="needs the real indexer"):
        dsa.indexer_forward_native(indexer, None, None, None, batch, 0)


def test_device_capability_answers_sm90_only_inside_the_hook():
    seen = []
    hook = dsa.device_capability_while(
        lambda: seen.append(torch.cuda.get_device_capability())
    )
    real = torch.cuda.get_device_capability
    hook()
    assert seen == [(9, 0)]
    assert torch.cuda.get_device_capability is real
