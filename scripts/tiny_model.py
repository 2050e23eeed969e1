"""Make a tiny Llama-family model locally: no download, deterministic.

``python scripts/tiny_model.py [NAME]`` writes a ``LlamaForCausalLM`` (2 layers,
hidden 128, 4 heads / 2 KV heads, vocab 2048, random bf16 weights, seed 0) as
safetensors, plus a byte-level BPE tokenizer trained here on generated text
(with a plain chat template),
into ``DIR`` (default ``build/tiny-llama``) and prints ``DIR``.  It is rebuilt
only when ``DIR/.stamp`` is missing or does not match this script's version.
The text it produces is garbage; the engine that produces it is real, which is
what the live-server tests and ``make serve-cpu`` need.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / "build" / "tiny-llama"
VERSION = "tiny-llama-v2"
VOCAB = 2048
CONTEXT = 4096
# A plain role-prefixed template, so the OpenAI chat route serves too.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

WORDS = (
    "cache prefix token rank host device page layer tree radix decode prefill "
    "router batch request server model kernel stream copy shard budget queue "
    "the a of to and in is for on with as by at from that this it be are was"
).split()


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(WORDS) for _ in range(n)]
        if i % 3 == 0:
            words.append(str(rng.randint(0, 99999)))
        out.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return out


def build_tokenizer(out: Path, add_bos: bool = False) -> None:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if add_bos:  # as Llama's tokenizers do: every encoding starts with <s>
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=CONTEXT,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def deepseek_config(config_class, layers: int, vocab_size: int, **extra):
    """A tiny DeepSeek config: every layer dense, latent 64 + rope 32."""
    return config_class(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,  # every layer dense (no MoE kernels)
        moe_layer_freq=1,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=CONTEXT,
        # the CPU rotary factory needs a scaling type; factor 1 = plain RoPE
        rope_scaling={
            "type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": CONTEXT,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        **extra,
    )


def build_mla_model(out: Path, vocab_size: int) -> None:
    """A tiny DeepSeek-V3 (plain MLA): 4 dense layers."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = deepseek_config(DeepseekV3Config, 4, vocab_size)
    config.architectures = ["DeepseekV3ForCausalLM"]
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def build_dsa_model(out: Path, vocab_size: int) -> None:
    """A tiny DeepSeek-V3.2 (MLA + DSA indexer): 4 dense layers, 4 indexer
    heads of 128; ``index_topk`` 2048 is above every prompt the tests send,
    so DSA selects every token (dense attention, which CPU torch computes)."""
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(0)
    config = deepseek_config(
        DeepseekV32Config,
        4,
        vocab_size,
        index_n_heads=4,
        index_head_dim=128,
        index_topk=2048,
    )
    config.architectures = ["DeepseekV32ForCausalLM"]
    model = DeepseekV32ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


# name -> (model builder, stamp version)
MODELS = {
    "tiny-llama": (build_model, VERSION),
    "tiny-mla": (build_mla_model, "tiny-mla-v1"),
    "tiny-dsa": (build_dsa_model, "tiny-dsa-v1"),
    # tiny-llama's weights; its tokenizer adds <s> to every prompt, so an
    # empty text is one token (the other tiny models add no BOS).
    "tiny-llama-bos": (build_model, "tiny-llama-bos-v1"),
}
ADDS_BOS = {"tiny-llama-bos"}


def model_dir(name: str) -> Path:
    return ROOT / "build" / name


def ensure(target: Path = DEFAULT_DIR, name: str = "tiny-llama") -> Path:
    builder, version = MODELS[name]
    stamp = target / ".stamp"
    if stamp.is_file() and stamp.read_text().strip() == version:
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp, add_bos=name in ADDS_BOS)
    vocab = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
    builder(tmp, max(vocab, 3))
    (tmp / ".stamp").write_text(version + "\n")
    # Replace the old copy only once the new one is complete.
    if target.exists():
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return target


if __name__ == "__main__":
    # python scripts/tiny_model.py [NAME]   (a key of MODELS)
    name = sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"
    print(ensure(model_dir(name), name))
