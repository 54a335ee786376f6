"""Everyday models at test size: Hugging Face GPT-2 and Llama from configs, torchvision ResNet-18 and a
ViT encoder. Used by test_real_models.py, and as CLI factories
(``torch-ext step tests/python/real_models.py:resnet18``), each returning
(model, optimizer, loss_fn, example_batch, batches).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 64, 16, 2
CLASSES = 10


def tiny_gpt2(**kw):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
                                  **kw)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def tiny_llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def tiny_causal_lm(family: str):
    """A grouped-query-attention causal LM of another Hugging Face family (4 query heads, 2 key/value
    heads): "mistral", "qwen2" (biases on q, k, v) or "gemma"."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    configs = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
               "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(head_dim=8))}
    config, model, extra = configs[family]
    torch.manual_seed(0)
    return model(config(**common, **extra)).train()


def tiny_family(family: str, **config):
    """Families the step meets in the wild beyond the Llama-style ones: "mixtral" (top-2 of 4 experts,
    router aux loss in the loss), "gemma2" (logit soft-capping, sliding-window layers alternating with
    global ones) and "bert" (masked LM, decoder tied to the embeddings, labels -100 off the masked tokens)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
            router_aux_loss_coef=0.02, bos_token_id=0, eos_token_id=0, pad_token_id=0, **config)).train()
    if family == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)).train()
    if family == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**common, pad_token_id=0)).train()
    raise ValueError(f"unknown family {family!r}")


# The families of more_families(): the attention and block layouts interpretability and training users meet
# beyond the Llama-style decoders, each with its dropout on.
MORE_FAMILIES = ("gpt_neox", "gpt_neox_sequential", "opt", "gptj", "phi", "phi3", "falcon", "falcon_alibi",
                 "falcon_40b", "t5")


def more_families(family: str, layers: int = 2, dropout: float = 0.1):
    """A tiny model of one of MORE_FAMILIES, in training mode: "gpt_neox" (Pythia: parallel attention and MLP,
    rotary on a quarter of each head), "gpt_neox_sequential" (use_parallel_residual=False), "opt" (learned
    positions from the attention mask's cumsum), "gptj" (parallel, interleaved rotary on 4 dims), "phi"
    (parallel, partial rotary, one LayerNorm), "phi3" (fused qkv and gate_up, grouped-query attention), "falcon"
    (7B: parallel, multi-query, rotary), "falcon_alibi" (RW-1B: sequential, ALiBi, biases), "falcon_40b" (the
    new decoder architecture: two LayerNorms, 2 key/value heads), "t5" (encoder-decoder, relative position
    bias, labels shifted into decoder inputs). ``layers``: decoder layers (T5: encoder and decoder layers each)."""
    import transformers as T

    d = dropout
    ids = dict(bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    if family.startswith("gpt_neox"):
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=SEQ, rotary_pct=0.25, use_parallel_residual=family == "gpt_neox",
            hidden_dropout=d, attention_dropout=d, **ids)).train()
    if family == "opt":
        return T.OPTForCausalLM(T.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, ffn_dim=64, num_attention_heads=4,
            max_position_embeddings=SEQ, dropout=d, attention_dropout=d, word_embed_proj_dim=32, pad_token_id=1,
            **ids)).train()
    if family == "gptj":
        return T.GPTJForCausalLM(T.GPTJConfig(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=layers, n_head=4, rotary_dim=4, resid_pdrop=d,
            embd_pdrop=d, attn_pdrop=d, **ids)).train()
    if family == "phi":
        return T.PhiForCausalLM(T.PhiConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            max_position_embeddings=SEQ, partial_rotary_factor=0.5, resid_pdrop=d, embd_pdrop=d,
            attention_dropout=d, **ids)).train()
    if family == "phi3":
        return T.Phi3ForCausalLM(T.Phi3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, resid_pdrop=d, embd_pdrop=d, attention_dropout=d,
            pad_token_id=0, **ids)).train()
    if family.startswith("falcon"):
        layout = {"falcon": dict(parallel_attn=True, multi_query=True, new_decoder_architecture=False, alibi=False),
                  "falcon_alibi": dict(parallel_attn=False, multi_query=False, new_decoder_architecture=False,
                                       alibi=True, bias=True),
                  "falcon_40b": dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False)}[family]
        return T.FalconForCausalLM(T.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, hidden_dropout=d,
            attention_dropout=d, max_position_embeddings=SEQ, **layout, **ids)).train()
    if family == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=d,
            decoder_start_token_id=0, pad_token_id=0)).train()
    raise ValueError(f"unknown family {family!r}; one of {MORE_FAMILIES}")


def tiny_bloom():
    """Hugging Face BLOOM (ALiBi attention), whose MLP applies its own torch.autograd.Function (GeLUFunction, with
    a hand-written backward)."""
    import transformers

    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.BloomForCausalLM(cfg).train()


def tiny_resnet18():
    """torchvision's ResNet-18 as is (BatchNorm in training mode), 10 classes."""
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=CLASSES).train()


def tiny_vit():
    """torchvision's VisionTransformer (the vit_b_16 architecture) shrunk: 32x32 images, 8x8 patches."""
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64,
                                                mlp_dim=128, num_classes=CLASSES).train()


def causal_lm_loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


def classify_loss(m, x, y):
    return F.cross_entropy(m(x), y)


def token_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),) for _ in range(n)]


def image_batches(n, batch=4, size=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
            for _ in range(n)]


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


# ---- CLI factories: (model, optimizer, loss_fn, example_batch, batches)
def _cli_factory(build, make_batches, loss_fn):
    model = build()
    batches = make_batches(4)
    return model, adamw(model), loss_fn, batches[0], batches


def gpt2():
    return _cli_factory(tiny_gpt2, token_batches, causal_lm_loss)


def llama():
    return _cli_factory(tiny_llama, token_batches, causal_lm_loss)


def resnet18():
    return _cli_factory(tiny_resnet18, image_batches, classify_loss)


def vit():
    return _cli_factory(tiny_vit, image_batches, classify_loss)
