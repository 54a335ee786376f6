"""Reentrant activation checkpoints under CPU bfloat16 autocast, trained bit-exact against eager.

Eager's reentrant backward (``CheckpointFunction.backward``) reruns the block in a fresh outermost autocast region
on ``detach()``-ed copies of its tensor arguments made to require grad: leaves, so autocast's weight cache casts
each once for the whole block, as it does a parameter. Two ops reading the block's input (BERT's query, key and
value projections) share one bfloat16 copy, and their gradients are added in bfloat16 before the one cast back;
a weight read twice inside the block likewise. The step cast at each use and added the float32 gradients: Hugging
Face BERT checkpointed reentrantly trained a few ulp off eager from the first update, silently (its forward values
are the same under eager's no_grad forward and its grad-mode recomputation: no op there depends on grad mode).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import torch_ext

sys.path.insert(0, str(Path(__file__).parent))


class Block(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.a, self.b = kind, nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        if self.kind == "weight_twice":  # one weight cast twice inside the block
            return self.a(torch.tanh(self.a(x)))
        if self.kind == "mlp":  # every leaf cast once: nothing to share
            return self.b(torch.relu(self.a(x)))
        return self.a(x) * self.b(x)  # the block's argument cast twice


class Net(nn.Module):
    def __init__(self, kind, reentrant=True, dtype=torch.bfloat16, cache=True):
        super().__init__()
        self.reentrant, self.dtype, self.cache = reentrant, dtype, cache
        # A float32 elementwise scale before the block: its gradient reads the block input's in float32.
        self.scale, self.blk, self.out = nn.Parameter(torch.rand(64) + 0.5), Block(kind), nn.Linear(64, 1)

    def forward(self, x):
        with torch.autocast("cpu", dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None,
                            cache_enabled=self.cache):
            h = x * self.scale
            h = checkpoint(self.blk, h, use_reentrant=self.reentrant) if self.reentrant is not None else self.blk(h)
            return self.out(torch.tanh(h)).float().sum()


def loss_fn(m, x):
    return m(x)


def train_both(model, steps=4):
    """Losses and parameters of the step and of eager after ``steps`` SGD updates; asserts bitwise equality."""
    torch.manual_seed(1)
    xs = [torch.randn(5, 7, 64) for _ in range(steps)]
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.01), torch.optim.SGD(ref.parameters(), lr=0.01)
    step = torch_ext.make_train_step(model, opt, loss_fn, (xs[0],))
    state = step.init_state()
    for i, x in enumerate(xs):
        loss, state = step(state, x)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref, x)
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(loss.reshape(()), ref_loss.detach()), (i, loss.item(), ref_loss.item())
    differ = {n: (state.params["model." + n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()
              if not torch.equal(state.params["model." + n], p.detach())}
    assert differ == {}, differ
    return step


@pytest.mark.parametrize("kind", ["argument_twice", "weight_twice"])
def test_reentrant_block_under_bf16_autocast_shares_eagers_cached_casts_bit_exact(kind):
    # Before: argument_twice diverged at step 3 (loss -45.047 vs eager -45.023), weight_twice at step 1 (-17.566 vs
    # -17.568).
    train_both(Net(kind))


@pytest.mark.parametrize("kind", ["argument_twice", "weight_twice"])
@pytest.mark.parametrize("variant", ["float32", "cache_disabled", "non_reentrant"])
def test_controls_bit_exact(kind, variant):
    # No autocast, autocast without its weight cache, non-reentrant checkpointing: exact before and after.
    train_both(Net(kind, dtype=None if variant == "float32" else torch.bfloat16, cache=variant != "cache_disabled",
                   reentrant=False if variant == "non_reentrant" else True))


def _casts(step):
    return sum(1 for n in step.joint_graph.nodes() if "_to_copy" in str(n.target))


def test_a_block_casting_each_leaf_once_keeps_its_program():
    # Nothing to share: the reentrant step's programs are the unchecked model's, node for node.
    torch.manual_seed(0)
    model = Net("mlp")
    plain = copy.deepcopy(model)
    plain.reentrant = None
    step, plain_step = train_both(model), train_both(plain)
    assert len(list(step.joint_graph.nodes())) == len(list(plain_step.joint_graph.nodes()))
    assert len(step._forward_program.graph.nodes) == len(plain_step._forward_program.graph.nodes)
    assert _casts(step) == _casts(plain_step)


def test_the_shared_argument_cast_is_one_cast():
    # The block's argument is cast once (eager's recomputation), where the unchecked model casts it per use: one
    # cast to bfloat16 fewer, and one gradient cast back to float32 fewer.
    torch.manual_seed(0)
    model = Net("argument_twice")
    plain = copy.deepcopy(model)
    plain.reentrant = None
    assert _casts(train_both(model, steps=1)) == _casts(train_both(plain, steps=1)) - 2


def test_bert_checkpointed_reentrantly_under_bf16_autocast_bit_exact():
    transformers = pytest.importorskip("transformers")
    import real_models as rm
    from test_real_models import run_parity, tokenizer_batches

    # Before: word_embeddings.weight differs after 4 AdamW steps (with dropout: step 3's loss 1.0903520 vs
    # eager 1.0903572). A padding mask, hidden dropout, eager's and SDPA's attention.
    for attn in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=rm.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=rm.SEQ, pad_token_id=0, num_labels=3, hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.0)).train()
        model.config.problem_type = "single_label_classification"  # else set in the first forward: refused
        model.set_attn_implementation(attn)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        batches = [(ids, mask, ids[:, 0] % 3) for ids, mask in tokenizer_batches(4)]

        def loss(m, ids, mask, labels):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(input_ids=ids, attention_mask=mask, labels=labels).loss

        run_parity(model, loss, batches, rtol=0.0)


class Tied(nn.Module):
    """``a`` read inside a reentrant block and again before or after it, in one autocast region."""

    def __init__(self, where, grad_input=True):
        super().__init__()
        self.grad_input = grad_input
        self.where, self.scale, self.a, self.out = where, nn.Parameter(torch.rand(64) + 0.5), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x * self.scale if self.grad_input else x
            if self.where == "before":
                h = torch.tanh(self.a(h))
            h = checkpoint(lambda u: torch.tanh(self.a(u)), h, use_reentrant=True)
            if self.where == "after":
                h = self.a(h)
            return self.out(h).float().sum()


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_weight_read_in_a_reentrant_block_and_after_it_follows_eagers_cache(where):
    # Eager's forward runs the block under no_grad: its cast of a.weight enters the region's cache without a
    # gradient, and the read after the block gets that copy, so no gradient from it (before: the step gave one,
    # loss 1 -24.412 vs eager -20.285). Read before the block, the cache's copy has a gradient: exact before too.
    torch.manual_seed(0)
    train_both(Tied(where))


def test_a_weight_read_in_a_reentrant_block_without_grad_inputs_and_after_it_follows_eagers_cache():
    # The block's only argument is the batch: eager runs it under no_grad and never recomputes it (no gradient for
    # the block), and its cast of a.weight, cached without a gradient, is what the read after the block gets. The
    # step traced that block in grad mode and gave the read after it a gradient (loss 1 -23.799 vs eager -19.680).
    torch.manual_seed(0)
    train_both(Tied("after", grad_input=False))
