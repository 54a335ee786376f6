"""The pure step on Hugging Face models built from small configs: 100 steps bit-exact with eager.

GPT-2 has tied input/output embeddings and dropout on (embedding, attention, residual); the step
and the eager loop share one RNG seed. Both use AdamW with a linear-warmup + cosine schedule.
Needs `transformers` (skipped with the reason otherwise); sizes are tiny so each test takes seconds.
"""
from __future__ import annotations

import copy

import pytest
import torch

import torch_ext

transformers = pytest.importorskip("transformers", reason="needs the transformers package (pip install transformers)")

STEPS = 100
VOCAB, SEQ, BATCH = 64, 16, 2


def warmup_cosine(opt):
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 10)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[10])


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def causal_lm_loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


def run_parity(model, loss_fn, batches, *, seed=3, clip=None, compiled=False, rtol=0.0):
    ref = copy.deepcopy(model)
    opt, ref_opt = adamw(model), adamw(ref)
    sched, ref_sched = warmup_cosine(opt), warmup_cosine(ref_opt)
    step = torch_ext.make_train_step(model, opt, loss_fn, batches[0], scheduler=sched, clip_grad_norm=clip)
    runner = step.compile(plan=True, donate=True) if compiled else step
    state = step.init_state(seed=seed)
    losses = []
    for b in batches:
        loss, state = runner(state, *b)
        losses.append(loss)
    torch.manual_seed(seed)
    worst = {"loss": 0.0, "param": 0.0}
    for i, b in enumerate(batches):
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref, *b)
        ref_loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_sched.step()
        worst["loss"] = max(worst["loss"], _rel(losses[i], ref_loss.detach()))
        assert worst["loss"] <= rtol, f"step {i}: {losses[i].item()!r} vs {ref_loss.item()!r}"
    for n, p in ref.named_parameters():
        worst["param"] = max(worst["param"], _rel(state.params["model." + n], p.detach()))
        assert worst["param"] <= rtol, n
    print(f"parity over {len(batches)} steps: worst relative difference {worst}")
    assert [float(v) for v in state.lr] == [g["lr"] for g in ref_opt.param_groups]
    return step, state


def _rel(a, b):
    """Max-norm relative difference; 0.0 exactly when the tensors are bitwise equal."""
    if torch.equal(a, b):
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def token_batches(n=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),) for _ in range(n)]


def tiny_gpt2(**kw):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
                                  **kw)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def test_gpt2_tied_dropout_adamw_warmup_cosine_bit_exact():
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    step, state = run_parity(model, causal_lm_loss, token_batches())
    assert step.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert step.draws_random
    assert "model.lm_head.weight" not in state.params


def test_gpt2_untied_with_clipping_through_the_planned_arena():
    # Untied embeddings make export lift a tensor constant (the old KeyError 'model.lifted_tensor_0').
    model = tiny_gpt2(tie_word_embeddings=False)
    assert model.lm_head.weight is not model.transformer.wte.weight
    run_parity(model, causal_lm_loss, token_batches(40), clip=0.5, compiled=True)


def test_llama_style_model_within_1e6():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    # Not bit-exact: a few layer-1 weight gradients differ from eager autograd's in the last bits
    # (about 1e-8 absolute on the first step), so the tolerance is 1e-6 relative, as the issue states.
    run_parity(model, causal_lm_loss, token_batches(STEPS), rtol=1e-6)
