"""Repro: Hugging Face T5 (SDPA) trained with torch_ext.make_train_step under CPU bfloat16 autocast, 3 AdamW
steps, against eager. Prints each step's losses and every parameter that is not torch.equal to eager's, with its
max abs diff. Usage: python scripts/repro_t5_autocast.py [--dropout 0.1] [--ckpt] [--attn sdpa|eager] [--pad]"""
import argparse
import copy
import sys

import torch
import transformers

import torch_ext

p = argparse.ArgumentParser()
p.add_argument("--dropout", type=float, default=0.0)
p.add_argument("--ckpt", action="store_true", help="gradient_checkpointing_enable(use_reentrant=False)")
p.add_argument("--attn", default="sdpa")
p.add_argument("--pad", action="store_true", help="left-pad row 0 of batch 1 (a tokenizer's mask)")
p.add_argument("--nomask", action="store_true", help="no attention_mask in the forward")
p.add_argument("--bf16", action="store_true", help="a bfloat16 model, no autocast")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--sgd", action="store_true", help="SGD lr=1: each step's update is minus the gradient")
a = p.parse_args()
torch.set_num_threads(1)
V, S, B = 100, 16, 2
torch.manual_seed(0)
model = transformers.T5ForConditionalGeneration(transformers.T5Config(
    vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=a.layers, num_decoder_layers=a.layers, num_heads=4,
    relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=a.dropout,
    decoder_start_token_id=0, pad_token_id=0, attn_implementation=a.attn)).train()
if a.bf16:
    model = model.to(torch.bfloat16)
if a.ckpt:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
g = torch.Generator().manual_seed(1)
batches = []
for i in range(a.steps + 1):
    ids = torch.randint(3, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    if a.pad and i % 3 == 1:
        mask[0, :3] = 0
    batches.append((ids, mask, ids.masked_fill(mask == 0, -100)))


def loss_fn(m, ids, mask, labels):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not a.bf16):
        return m(input_ids=ids, attention_mask=None if a.nomask else mask, labels=labels).loss


ref = copy.deepcopy(model)
make_opt = ((lambda m: torch.optim.SGD(m.parameters(), lr=1.0)) if a.sgd else
            (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)))
opt, ref_opt = make_opt(model), make_opt(ref)
step = torch_ext.make_train_step(model, opt, loss_fn, batches[0])
state = step.init_state(seed=3)
snaps, losses = [], []
for i in range(a.steps):  # the step first (its RNG lives in its state), then eager from the same seed
    loss, state = step(state, *batches[i])
    losses.append(loss.reshape(()))
    snaps.append({k: v.clone() for k, v in state.params.items()})
torch.manual_seed(3)
bad = 0
for i in range(a.steps):
    ref_opt.zero_grad()
    ref_loss = loss_fn(ref, *batches[i])
    ref_loss.backward()
    ref_opt.step()
    print(f"step {i}: loss {losses[i].item()!r} eager {ref_loss.item()!r} equal {torch.equal(losses[i], ref_loss.detach())}")
    for n, p_ in ref.named_parameters():
        q = snaps[i].get("model." + n)
        if q is None:
            continue  # tied: held under its first name
        if not torch.equal(q, p_.detach()):
            bad += 1
            print(f"   {n}: max abs diff {(q - p_.detach()).abs().max().item():.3g}")
print("ALL EQUAL" if bad == 0 else f"{bad} parameter mismatches (summed over steps)")
sys.exit(1 if bad else 0)
