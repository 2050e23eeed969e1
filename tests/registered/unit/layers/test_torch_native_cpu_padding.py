"""DP attention on CPU pads each batch to the DP group's size
(``ForwardBatch._pad_inputs_to_size``) with the attention backend's CPU fill
value for the padding rows' seq lens. 0.5.23's ``TorchNativeAttnBackend``, the
CPU backend that needs no CPU kernel, has none: the first request of a
``--device cpu --attention-backend torch_native --enable-dp-attention`` server
raised AttributeError in the scheduler and the server went down.

The real backend and the real padding, on the CPU branch of
``_pad_inputs_to_size`` (``_is_cpu``, which the CPU engine sets at import).
"""

import unittest
from types import SimpleNamespace
from unittest import mock

import torch
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")


class TestTorchNativeCpuPadding(unittest.TestCase):
    def test_dp_attention_padding_rows_get_seq_len_one(self):
        from sglang.srt.layers.attention.torch_native_backend import (
            TorchNativeAttnBackend,
        )
        from sglang.srt.model_executor import forward_batch_info
        from sglang.srt.model_executor.forward_batch_info import (
            ForwardBatch,
            ForwardMode,
        )

        backend = TorchNativeAttnBackend(
            SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None)
        )
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=2,
            input_ids=torch.tensor([5, 6]),
            req_pool_indices=torch.tensor([1, 2]),
            seq_lens=torch.tensor([3, 4]),
            out_cache_loc=torch.tensor([7, 8]),
            seq_lens_sum=7,
            positions=torch.tensor([2, 3]),
        )
        with mock.patch.object(forward_batch_info, "_is_cpu", True):
            try:
                batch._pad_inputs_to_size(SimpleNamespace(attn_backend=backend), 4, 4)
            except AttributeError as e:  # 0.5.23: no CPU fill value on this backend
                self.fail(f"padding a CPU batch for TorchNativeAttnBackend: {e}")
        # Two padding rows of one token each, as the other CPU backends pad.
        self.assertEqual(batch.seq_lens.tolist(), [3, 4, 1, 1])
        self.assertEqual(batch.seq_lens_sum, 3 + 4 + 1 + 1)
        self.assertEqual(batch.input_ids.tolist(), [5, 6, 0, 0])
        self.assertEqual(batch.req_pool_indices.tolist(), [1, 2, 0, 0])


if __name__ == "__main__":
    unittest.main()
