"""A generate request's path from its JSON body to the scheduler's sampling
tensors, on CPU, without a server.

``Admission(vocab, context_len)`` holds a ``TokenizerManager`` made with
``object.__new__`` plus the attributes its validation and tokenization read
(a real ``ModelConfig`` of a one-layer Llama of that vocabulary, a byte-level
stand-in tokenizer). ``admit(body)`` runs what
``TokenizerManager.generate_request`` runs before it sends a request to the
scheduler: ``GenerateReqInput(**body)``, ``normalize_batch_and_arguments``,
``_init_req_state`` and ``_tokenize_one_request`` for every prompt (which
validates the request, builds ``SamplingParams``, normalizes and verifies
them). A ``ValueError`` from any of these is what the HTTP layer answers 400.

``schedule(tokenized)`` runs what the scheduler builds from the admitted
requests: real ``Req`` objects, ``Scheduler.init_req_max_new_tokens``'s
clipping, ``SamplingBatchInfo.from_schedule_batch`` (the int32 top_k and
float tensors, the logit-bias row, the penalizers with the min-new-tokens
int32 tensor and the stop-id scatter), one step of the torch sampler on
random logits, and the top-logprob and token-id logprob gathers. Any
exception there is one that would raise in the scheduler.
"""

from __future__ import annotations

import asyncio
import tempfile
from types import SimpleNamespace

import torch

UPSTREAM_TEST_MODULE = "sglang.test.request_admission_stack"

EOS = 1


class ByteTokenizer:
    """Byte-level stand-in: what SamplingParams.normalize and the penalizers
    read from a tokenizer."""

    eos_token_id = EOS
    additional_stop_token_ids = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text, add_special_tokens=False):
        return [2 + b % (self.vocab - 2) for b in text.encode("utf-8")]

    def __call__(self, texts, **kwargs):
        single = isinstance(texts, str)
        ids = [self.encode(t) for t in ([texts] if single else texts)]
        return {"input_ids": ids[0] if single else ids}


class _Batch:
    """What SamplingBatchInfo.from_schedule_batch reads from a batch (the
    penalizer orchestrator keeps a weak reference to it)."""

    def __init__(self, reqs):
        self.reqs = reqs
        self.device = "cpu"


class Admission:
    def __init__(self, vocab: int = 100, context_len: int = 512):
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from sglang.srt.runtime_context import publish
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.server_args import ServerArgs
        from transformers import LlamaConfig

        path = tempfile.mkdtemp(prefix="admission-model-")
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=context_len,
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(path)
        server_args = ServerArgs(
            model_path=path, device="cpu", sampling_backend="pytorch"
        )
        publish(server_args, role="tokenizer")
        self.vocab = vocab
        self.tokenizer = ByteTokenizer(vocab)
        m = object.__new__(TokenizerManager)
        m.model_config = ModelConfig.from_server_args(server_args)
        m.context_len = m.model_config.context_len
        assert m.context_len == context_len, m.context_len
        self.context_len = context_len
        m.allow_auto_truncate = False
        m.validate_total_tokens = True
        m.num_reserved_tokens = 0
        m.is_generation = True
        m.tokenizer = self.tokenizer
        m.mm_processor = None
        m.max_req_input_len = None
        m.preferred_sampling_params = None
        m.sampling_params_class = SamplingParams
        m.tokenized_generate_req_type = TokenizedGenerateReqInput
        m.fake_bootstrap_room_counter = 0
        m.rid_to_state = {}
        m.enable_trace = False
        m.disaggregation_mode = server_args.disaggregation_mode
        m.async_dynamic_batch_tokenizer = None
        self.manager = m

    # -- the tokenizer manager's side ------------------------------------
    def admit(self, body: dict) -> list:
        """The tokenized requests ``body`` becomes, or the ValueError the
        server answers 400."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        m = self.manager
        m.rid_to_state.clear()
        obj = GenerateReqInput(**body)
        obj.normalize_batch_and_arguments()
        m._init_req_state(obj)
        subs = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]

        async def tokenize():
            return [await m._tokenize_one_request(sub) for sub in subs]

        return asyncio.run(tokenize())

    # -- the scheduler's side --------------------------------------------
    def schedule(self, tokenized: list, seed: int = 0) -> list:
        """Build what the scheduler builds and run one sampling step; return
        the sampled token ids."""
        from sglang.srt.layers.logprob_processor import (
            get_token_ids_logprobs,
            get_top_logprobs,
        )
        from sglang.srt.layers.sampler import Sampler
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

        reqs = []
        for t in tokenized:
            req = Req(
                t.rid,
                t.input_text,
                t.input_ids,
                t.sampling_params,
                return_logprob=t.return_logprob,
                top_logprobs_num=t.top_logprobs_num,
                token_ids_logprob=t.token_ids_logprob,
                stream=t.stream,
                eos_token_ids={EOS},
                vocab_size=self.vocab,
            )
            req.tokenizer = self.tokenizer
            Scheduler.init_req_max_new_tokens(self._scheduler_limits(), req)
            reqs.append(req)
        info = SamplingBatchInfo.from_schedule_batch(_Batch(reqs), self.vocab)
        info.update_penalties()
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(len(reqs), self.vocab, generator=generator)
        info.apply_logits_bias(logits)
        logits = Sampler._preprocess_logits(None, logits, info)
        if info.is_all_greedy:
            ids = torch.argmax(logits, -1)
        else:
            logits.div_(info.temperatures)
            probs = torch.softmax(logits, dim=-1)
            # The sampler needs a distribution: a NaN row is sampled as token
            # 0 by the default Gumbel path and raises in torch.multinomial.
            if not torch.isfinite(probs).all():
                raise FloatingPointError(f"non-finite sampling probabilities: {probs}")
            simple = not (
                info.need_top_p_sampling
                or info.need_top_k_sampling
                or info.need_min_p_sampling
            )
            positions = torch.zeros(len(reqs), dtype=torch.int64)
            ids, _ = Sampler._sample_from_probs(None, probs, info, positions, simple)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if any(t.return_logprob for t in tokenized):
            nums = [t.top_logprobs_num if t.return_logprob else 0 for t in tokenized]
            if any(x > 0 for x in nums):
                _, rows = get_top_logprobs(logprobs, nums)
                for num, row in zip(nums, rows):
                    if len(row) != max(num, 0):
                        raise IndexError(f"top_logprobs_num {num}: {len(row)} entries")
            token_ids = [
                t.token_ids_logprob if t.return_logprob else None for t in tokenized
            ]
            if any(x is not None for x in token_ids):
                get_token_ids_logprobs(logprobs, token_ids)
        info.penalizer_orchestrator.cumulate_output_tokens(ids.view(-1).long())
        return ids.tolist()

    def _scheduler_limits(self):
        """What Scheduler.init_req_max_new_tokens reads: a KV pool with room
        for any request the context admits."""
        allocator = SimpleNamespace(
            max_new_tokens_for_memory=lambda input_len, max_new_tokens, **kw: (
                max_new_tokens
            )
        )
        return SimpleNamespace(
            max_new_tokens_limit=None,
            max_req_len=self.context_len - 1,
            max_total_num_tokens=1 << 20,
            kv_shard_widening=1,
            page_size=1,
            token_to_kv_pool_allocator=allocator,
            sliding_window_size=None,
            chunked_prefill_size=-1,
        )
