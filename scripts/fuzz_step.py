#!/usr/bin/env python
"""Differential fuzzer for the training step: its VALUES against an eager PyTorch loop, bit for bit.

Each case is a seeded random training setup (a spec, JSON): a small model composed of Linear, Conv1d/2d,
Embedding, LayerNorm, BatchNorm (train mode), Dropout, GELU/ReLU/SiLU/tanh, residual adds, a weight shared by
two layers, a buffer read in forward and one written in forward, frozen parameters and parameters in no
optimizer; an optimizer of every kind torch_ext supports (torch_ext/optim/_registry.py) with random
hyperparameters, one or two param groups (Muon: Muon on the 2-D weights beside AdamW on the rest); and
options: the executor, ``compile(plan=True)`` with or without donation or with a ``memory_budget``,
``accumulate=2``, ``clip_grad_norm``, a scheduler (StepLR / LambdaLR / OneCycleLR), batch 1 or 4. Seeds 10 and
up add the ground of ``extend_spec``: attention (SDPA, MultiheadAttention, TransformerEncoderLayer), GRU/LSTM,
GroupNorm/RMSNorm/InstanceNorm, ConvTranspose, pooling, a transposed weight Parameter, cross-entropy options,
BCE/Huber, ``reduction="sum"``, float64, per-group hyperparameters, ``set_lr`` between calls and ``unroll=2``.
Seeds 18 and up add real scripts' habits (``real_spec``); seeds 28 and up the ground of ``wild_spec``: ``torch.cond``
on data-dependent predicates (more often under autocast), Hugging Face layers (LlamaDecoderLayer, GPT2Block),
in-place ops on activations, where/gather/scatter with data masks and indices, cumsum and its kin, parameter views,
activation checkpointing, GLU, and loss regularisers. Seeds 36 and up (``model_spec``): half the cases train a whole
Hugging Face model from a tiny config (GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, OPTForCausalLM,
GPTNeoXForCausalLM, BertForSequenceClassification, BertForMaskedLM, T5ForConditionalGeneration) with its own loss
(``labels=`` with -100 positions, ``attention_mask`` with left / right padding that differs per batch), its dropout,
activation checkpointing, tied or untied embeddings, a tuple / dict / BatchEncoding batch, bfloat16 autocast and
transformers' lr schedules; and half of all cases (``"save": true``) also save ``step.program`` as a ``.pt2``, load it
with ``torch_ext.load_step`` and train the same calls through it, which must equal the live step bit for bit
(``FUZZ_STEP_SAVE=1`` turns that on for the cases of any seed).

The case trains 3 steps through the step and through eager PyTorch (same initial weights, the same RNG:
``init_state(seed=s)`` against ``torch.manual_seed(s)``), comparing with torch.equal each step's loss and,
after ``write_back``, every parameter, buffer, optimizer.state slot, param-group hyperparameter and the
scheduler's position. A refusal by name (an exception of the project's own kinds, no internal assert) is
fine; a value difference, a crash (signal) or an internal error is a finding, printed with its spec.

    python scripts/fuzz_step.py --seconds 600 --seed 1      # bounded run
    python scripts/fuzz_step.py --case 1:17                 # replay case 17 of seed 1, with details
    python scripts/fuzz_step.py --spec '{"front": ...}'     # replay a (hand-minimised) spec

Cases run in a worker subprocess, so a crash is caught and the run continues with the next case.
"""
from __future__ import annotations

import copy
import os
import random
import re
import sys

import _fuzz_driver
from _fuzz_driver import one_intra_op_thread
STEPS = 3
ACTS = ("gelu", "relu", "silu", "tanh")
BLOCKS = ("linear", "ln", "bn", "act", "drop", "resid", "shared", "bufscale", "ema")
OPTS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Muon", "Lion", "Adamax", "NAdam", "RAdam", "Adadelta",
        "Rprop", "Adafactor")
FOREACH_EXACT = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "Adadelta", "Rprop")
# Seeds from EXTENDED_SEED on draw the extended ground below after the draws above (so seeds 0..9 replay as before).
EXTENDED_SEED = 10
ACTS2 = ACTS + ("mish", "hardswish", "elu", "leaky_relu", "softplus", "sigmoid")
ANY_BLOCKS = ("rms", "tlin", "act2")                       # blocks on a [B, D] or [B, T, D] stream
SEQ_BLOCKS = ("sdpa", "mha", "gru", "lstm", "gn", "inorm", "convT", "pool", "dwconv", "tel")  # [B, T, D] only
# Seeds from REAL_SEED on also draw ``real_spec`` (after the two above, so seeds 10..17 replay as before).
REAL_SEED = 18
REAL_BLOCKS = ("reuse", "unused", "nonpers", "tconst", "bn2", "drop2")
# Seeds from WILD_SEED on also draw ``wild_spec`` (after the three above, so seeds 18..27 replay as before).
WILD_SEED = 28
WILD_ANY = ("cond", "inplace", "where", "gather", "cumsum", "pview", "ckpt", "glu", "misc")  # [B, D] or [B, T, D]
WILD_SEQ = ("hf_llama", "hf_gpt2")                                                          # [B, T, D] only
# Seeds from MODEL_SEED on also draw ``model_spec`` (after the four above, so seeds 28..35 replay as before): whole
# Hugging Face models with their own loss, and the saved program (``.pt2``) run beside the live step.
MODEL_SEED = 36
HF_FAMILIES = ("gpt2", "llama", "qwen2", "opt", "gpt_neox", "bert_cls", "bert_mlm", "t5")
HF_SCHEDS = ("hf_linear", "hf_cosine", "hf_cosine_restarts", "hf_constant_warmup", "hf_poly", "hf_inverse_sqrt")
SCHEDS2 = ("exp", "multistep", "cosine", "cosine_wr", "linear", "constant", "poly", "cyclic", "sequential", "chained",
           "multiplicative", "plateau")


# ------------------------------------------------------------------------------------------ generator
def gen_spec(rng: random.Random) -> dict:
    """A random setup, as plain JSON data (so a finding can be replayed and minimised by hand)."""
    front = rng.choice(("linear", "embed", "conv1d", "conv2d"))
    batch = rng.choice((1, 4))
    blocks = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(BLOCKS)
        if kind == "bn" and front == "linear" and batch == 1:
            kind = "ln"  # eager refuses BatchNorm over one value per channel
        b = {"kind": kind}
        if kind in ("act", "resid", "shared"):
            b["act"] = rng.choice(ACTS)
        if kind == "drop":
            b["p"] = rng.choice((0.1, 0.5))
        blocks.append(b)
    opt = gen_opt(rng)
    spec = {
        "model_seed": rng.randrange(1000), "rng_seed": rng.randrange(1000), "data_seed": rng.randrange(1000),
        "front": front, "front_bn": front.startswith("conv") and rng.random() < 0.4,
        "padding_idx": front == "embed" and rng.random() < 0.3,
        "width": rng.choice((4, 6, 8)), "blocks": blocks, "loss": rng.choice(("ce", "mse")),
        "batch": batch, "frozen": rng.sample(range(12), rng.choice((0, 0, 1, 2))),
        "excluded": rng.sample(range(12), rng.choice((0, 0, 0, 1))),
        "opt": opt, "groups": rng.choice((1, 2)), "group2": {"lr_scale": rng.choice((0.5, 2.0)),
                                                              "wd": rng.choice((None, 0.0, 0.05))},
        "sched": rng.choice((None, None, "step", "lambda", "onecycle")),
        "cycle_momentum": rng.random() < 0.5,
        "accumulate": rng.choice((1, 1, 2)), "clip": rng.choice((None, None, 0.5, 10.0)),
        "runner": rng.choice(("exec", "exec", "plan", "donate", "budget")),
        "budget": rng.choice((0.6, 0.8)),
    }
    return spec


def extend_spec(spec: dict, rng: random.Random) -> dict:
    """The extended ground, drawn after ``gen_spec``: a sequence front, attention (SDPA with or without a causal or
    explicit mask and dropout, nn.MultiheadAttention, TransformerEncoderLayer), GRU/LSTM, GroupNorm, RMSNorm,
    InstanceNorm, ConvTranspose, pooling, depthwise conv, a transposed (non-contiguous) weight Parameter, more
    activations; embeddings with scale_grad_by_freq; cross-entropy with label smoothing / ignore_index / class
    weights, BCE, Huber, reduction="sum"; float64 models; per-group hyperparameters; set_lr between calls;
    ``unroll=2``."""
    if spec["front"] == "linear" and rng.random() < 0.5:
        spec["front"] = "seqlin"  # Linear over [B, T, 5]
    seq = spec["front"] != "linear"
    kinds = ANY_BLOCKS + (SEQ_BLOCKS if seq else ())
    for i in range(len(spec["blocks"])):
        if rng.random() < 0.6:
            kind = rng.choice(kinds)
            b = {"kind": kind}
            if kind == "act2":
                b["act"] = rng.choice(ACTS2)
            elif kind == "rms":
                b["eps"] = rng.choice((None, 1e-5))
                b["affine"] = rng.random() < 0.8
            elif kind == "sdpa":
                b["mask"] = rng.choice(("none", "causal", "bool", "float"))
                b["p"] = rng.choice((0.0, 0.0, 0.2))
                b["scale"] = rng.choice((None, 0.3))
            elif kind == "mha":
                b["mask"] = rng.choice(("none", "causal", "bool", "float"))
                b["p"] = rng.choice((0.0, 0.0, 0.2))
                b["bias"] = rng.random() < 0.7
                b["need_weights"] = rng.random() < 0.5
            elif kind in ("gru", "lstm"):
                b["layers"] = rng.choice((1, 1, 2))
                b["bi"] = rng.random() < 0.4
                b["p"] = rng.choice((0.0, 0.3)) if b["layers"] > 1 else 0.0
            elif kind == "gn":
                b["groups"] = rng.choice((1, 2))
            elif kind == "inorm":
                b["affine"] = rng.random() < 0.7
                b["track"] = rng.random() < 0.4
            elif kind == "pool":
                b["op"] = rng.choice(("max", "avg", "avg_nopad", "lp", "adaptive"))
            elif kind == "tel":
                b["norm_first"] = rng.random() < 0.5
                b["p"] = rng.choice((0.0, 0.1))
                b["act"] = rng.choice(("relu", "gelu"))
                b["causal"] = rng.random() < 0.4
            spec["blocks"][i] = b
    if spec["front"] == "embed":
        spec["scale_grad_by_freq"] = rng.random() < 0.4
    loss = rng.choice(("ce", "ce", "mse", "bce", "huber"))
    spec["loss"] = loss
    if loss == "ce":
        spec["ce"] = {"label_smoothing": rng.choice((0.0, 0.1)), "ignore": rng.random() < 0.3,
                      "weight": rng.random() < 0.3}
    spec["reduction"] = rng.choice(("mean", "mean", "sum"))
    spec["float64"] = rng.random() < 0.15
    if spec["groups"] == 2 and rng.random() < 0.5:
        spec["group2"]["hyper"] = _group_hyper(spec["opt"], rng)
    # unroll=2 with a scheduler is refused by design (one lr per unrolled call)
    spec["unroll"] = 2 if spec["accumulate"] == 1 and spec["sched"] is None and rng.random() < 0.2 else 1
    spec["set_lr"] = spec["sched"] is None and rng.random() < 0.25
    return spec


def real_spec(spec: dict, rng: random.Random) -> dict:
    """The features of real training scripts, drawn after ``extend_spec``: an embedding tied to the output head
    (GPT-2), one Linear applied twice in a forward (ALBERT), a parameter the loss never reaches (an unused pooler),
    a non-persistent buffer written in forward, a plain tensor attribute read as a constant, BatchNorm variants
    (momentum=None, affine=False, a frozen BatchNorm in eval mode inside a training model), other dropouts
    (functional, Dropout1d, AlphaDropout, FeatureAlphaDropout, inplace), every other lr scheduler (stepped eagerly
    before the build, too), ``.grad`` left by an eager warm-up backward with ``zero_grad(set_to_none=False)`` (and
    parameters frozen after it, holding a gradient), bfloat16 models and bfloat16 autocast, a tensor lr, and the
    optimizer flags the step refuses by name (fused, capturable, differentiable)."""
    for i in range(len(spec["blocks"])):
        if rng.random() < 0.35:
            kind = rng.choice(REAL_BLOCKS)
            b = {"kind": kind}
            if kind == "reuse":
                b["act"] = rng.choice(ACTS2)
            elif kind == "unused":
                b["nograd_read"] = rng.random() < 0.5  # its weight read under no_grad
            elif kind == "bn2":
                b["variant"] = rng.choice(("cumulative", "noaffine", "eval", "nostats"))
            elif kind == "drop2":
                b["variant"] = rng.choice(("functional", "d1", "alpha", "falpha", "inplace"))
                b["p"] = rng.choice((0.1, 0.5))
            spec["blocks"][i] = b
        elif spec["blocks"][i]["kind"] in ("gn", "inorm", "convT", "dwconv", "pool") and rng.random() < 0.4:
            spec["blocks"][i]["drop"] = rng.choice((0.2, 0.5))  # dropout channel-first, before transposing back
    spec["tie"] = spec["front"] == "embed" and rng.random() < 0.5
    if rng.random() < 0.4:
        spec["sched"] = rng.choice(SCHEDS2)
        spec["unroll"], spec["set_lr"] = 1, False
    spec["sched_pre"] = rng.choice((0, 0, 1, 2)) if spec["sched"] else 0
    spec["pre_grad"] = rng.choice((None, None, "none", "zero", "stale"))
    spec["freeze_after"] = rng.sample(range(12), 1) if spec["pre_grad"] and rng.random() < 0.3 else []
    spec["bf16"] = not spec.get("float64") and rng.random() < 0.12
    spec["autocast"] = not spec.get("float64") and not spec["bf16"] and rng.random() < 0.1
    spec["tensor_lr"] = rng.choice((None, None, None, "f64", "f32"))
    kind = spec["opt"]["kind"]
    r = rng.random()
    if r < 0.04 and kind in ("Adam", "AdamW", "SGD", "Adagrad"):
        spec["opt"]["hyper"]["fused"] = True
        spec["opt"]["hyper"].pop("foreach", None)
    elif r < 0.08 and kind not in ("Muon", "Lion", "Adafactor"):
        spec["opt"]["hyper"]["differentiable"] = True
    elif r < 0.12 and kind in ("Adam", "AdamW", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop"):
        spec["opt"]["hyper"]["capturable"] = True
    elif r < 0.18 and kind in ("NAdam", "RAdam", "Adafactor"):
        spec["opt"]["hyper"]["foreach"] = True
    return spec


def wild_spec(spec: dict, rng: random.Random) -> dict:
    """More of what training scripts and model code do, drawn after ``real_spec``: ``torch.cond`` on a
    data-dependent predicate (of the batch or of the stream; branches reading parameters, a buffer, a parameter
    also read outside; a nested cond; dropout in a branch), more often under bfloat16 autocast; Hugging Face layers
    (LlamaDecoderLayer with its rotary embedding, GPT2Block; sdpa or eager attention, dropout); in-place ops on
    activations (``add_``, ``relu_``, ``masked_fill_`` with a data mask, ``clamp_``, on a slice); ``torch.where``
    with data masks (a padding mask from the tokens); ``gather`` / ``index_select`` / ``scatter_add`` with data
    indices; cumsum / cummax / logcumsumexp; parameter views (a weight sliced, reshaped, chunked into a fused QKV,
    unbound, expanded); activation checkpointing (``torch.utils.checkpoint``, reentrant or not, dropout inside);
    SwiGLU/GeGLU; ``F.normalize``, einsum; and loss terms real scripts add (an L2 penalty over the parameters, a
    z-loss, a masked per-token mean)."""
    seq = spec["front"] != "linear"
    kinds = WILD_ANY + (WILD_SEQ if seq else ())
    for i in range(len(spec["blocks"])):
        if rng.random() < 0.5:
            kind = rng.choice(kinds)
            b = {"kind": kind}
            if kind == "cond":
                b["pred"] = rng.choice(("input", "input", "hidden", "row0"))
                b["share"] = rng.random() < 0.4      # one Linear in both branches
                b["outside"] = rng.random() < 0.3    # the branch's Linear also applied before the cond
                b["nested"] = rng.random() < 0.15
                b["act"] = rng.choice(ACTS2)
                b["two"] = rng.random() < 0.3        # two operands (the stream and the raw batch's statistic)
            elif kind == "inplace":
                b["op"] = rng.choice(("add_", "relu_", "masked_fill_", "mul_", "chain", "slice", "clamp_",
                                      "mask_softmax"))
            elif kind == "where":
                b["op"] = rng.choice(("hidden", "leaky", "pad", "param"))
            elif kind == "gather":
                b["op"] = rng.choice(("index_select", "gather", "scatter_add", "take_along", "pos_cumsum",
                                      "embedding"))
            elif kind == "cumsum":
                b["op"] = rng.choice(("cummean", "cumsum_last", "logcumsumexp", "cummax", "revcumsum"))
            elif kind == "pview":
                b["op"] = rng.choice(("slice", "reshape", "fused_qkv", "unbind", "expand", "diag", "strided"))
            elif kind == "ckpt":
                b["reentrant"] = rng.random() < 0.3
                b["p"] = rng.choice((0.0, 0.2))
                b["act"] = rng.choice(ACTS2)
            elif kind == "glu":
                b["op"] = rng.choice(("swiglu", "geglu"))
            elif kind == "misc":
                b["op"] = rng.choice(("normalize", "einsum", "softmax_mix", "logsigmoid", "bmm_attn"))
            elif kind in ("hf_llama", "hf_gpt2"):
                b["attn"] = rng.choice(("sdpa", "eager"))
                b["p"] = rng.choice((0.0, 0.1))
                b["mask"] = rng.choice(("none", "causal"))
                if kind == "hf_llama":
                    b["kv"] = rng.choice((1, 2))
                    b["bias"] = rng.random() < 0.3
                else:
                    b["act"] = rng.choice(("gelu_new", "gelu", "relu"))
            spec["blocks"][i] = b
    has_cond = any(b["kind"] == "cond" for b in spec["blocks"])
    if has_cond and not spec.get("float64") and not spec["bf16"] and rng.random() < 0.35:
        spec["autocast"] = True
    spec["reg"] = rng.choice((None, None, None, "l2", "zloss", "masked_mean"))
    if spec["reg"] == "masked_mean" and spec["loss"] != "ce":
        spec["reg"] = None
    return spec


def model_spec(spec: dict, rng: random.Random) -> dict:
    """Drawn after ``wild_spec``: half of the cases train a whole Hugging Face model (``spec["hf"]``, built from a
    tiny config, no download) with its own loss (``labels=``, -100 on padding and on random positions,
    ``attention_mask`` with right or left padding of a random length per row and batch, so the example batch's
    padding is not the later batches'), ``train()`` with the config's dropout, activation checkpointing (reentrant or
    not, every layer or every other), its attention implementation, tied or untied embeddings, a tuple, dict or
    ``BatchEncoding`` batch, bfloat16 autocast around the forward and its loss; transformers' lr schedules (warmup
    then linear / cosine / ...). Any case (``spec["save"]``) also saves ``step.program`` as a ``.pt2``, loads it with
    ``torch_ext.load_step`` and trains the same calls through it, which must equal the live step bit for bit."""
    if rng.random() < 0.5:
        fam = rng.choice(HF_FAMILIES)
        hf = {"family": fam, "layers": rng.choice((1, 2)), "p": rng.choice((0.0, 0.1, 0.1)),
              "attn": rng.choice(("sdpa", "eager")), "pad": rng.choice(("none", "right", "left", "mixed")),
              "mask": rng.random() < 0.8, "ignore": rng.random() < 0.4,
              "ckpt": rng.choice((None, None, "reentrant", "nonreentrant")), "ckpt_every": rng.choice((1, 1, 2)),
              "batch": rng.choice(("tuple", "tuple", "dict", "encoding")), "tie": rng.random() < 0.5,
              "autocast": not spec.get("float64") and rng.random() < 0.2, "seq": rng.choice((4, 6))}
        if fam == "bert_cls":
            hf["labels"] = rng.choice((1, 3))  # 1: regression (MSE on float labels)
            hf["token_types"] = rng.random() < 0.5
        if fam in ("llama", "qwen2"):
            hf["kv"] = rng.choice((1, 2))
        if fam == "gpt2":
            hf["act"] = rng.choice(("gelu_new", "gelu", "relu"))
        if fam == "gpt_neox":
            hf["parallel"] = rng.random() < 0.5
        if fam == "t5":
            hf["ff"] = rng.choice(("relu", "gated-gelu"))
        spec["hf"] = hf
        if rng.random() < 0.8:  # mostly without what older seeds already refuse by name (a float32 tensor lr,
            # the optimizer flags, a plateau schedule), so that most whole-model cases train
            spec["tensor_lr"] = None
            for k in ("fused", "capturable", "differentiable"):
                spec["opt"]["hyper"].pop(k, None)
            if spec["sched"] == "plateau":
                spec["sched"] = None
        if hf["autocast"]:
            spec["bf16"] = False
        spec["batch"] = rng.choice((1, 2, 4))
        if rng.random() < 0.35:
            spec["sched"] = rng.choice(HF_SCHEDS)
            spec["unroll"], spec["set_lr"] = 1, False
            spec["sched_pre"] = rng.choice((0, 0, 1))
    spec["save"] = rng.random() < 0.5
    return spec


def _group_hyper(opt: dict, rng: random.Random) -> dict:
    """Other values of some of the optimizer's hyperparameters, for the second param group."""
    h = opt["hyper"]
    alt = {"momentum": (0.0, 0.8), "betas": ([0.7, 0.95], [0.85, 0.98]), "eps": (1e-7,), "alpha": (0.95,),
           "amsgrad": (True, False), "nesterov": (False,), "dampening": (0.0,), "centered": (True, False),
           "rho": (0.8,), "lr_decay": (0.02,), "momentum_decay": (0.006,), "etas": ([0.4, 1.3],),
           "beta2_decay": (-0.7,), "d": (1.5,), "maximize": (True, False),
           "decoupled_weight_decay": (True, False)}
    out = {}
    for k, vals in alt.items():
        if k in h and rng.random() < 0.5:
            v = rng.choice(vals)
            if k == "nesterov" and opt["kind"] == "SGD":
                continue  # SGD's nesterov needs momentum and no dampening in its group
            if opt["kind"] == "Adafactor" and k == "eps":
                v = [None, 1e-3] if h["eps"][0] is not None else [1e-30, 1e-3]
            if opt["kind"] == "Lion" and k == "betas":
                v = [v[0], 0.99]
            if opt["kind"] == "SGD" and k == "momentum" and h.get("nesterov"):
                continue
            out[k] = v
    return out


def gen_opt(rng: random.Random) -> dict:
    kind = rng.choice(OPTS)
    wd = rng.choice((0.0, 0.0, 0.01, 0.1))
    maximize = rng.random() < 0.2
    betas = [rng.choice((0.9, 0.8, 0.5)), rng.choice((0.999, 0.99, 0.9))]
    h: dict = {}
    if kind == "SGD":
        mom = rng.choice((0.0, 0.9, 0.5))
        nesterov = mom > 0 and rng.random() < 0.4
        h = dict(lr=rng.choice((0.1, 0.05)), momentum=mom, dampening=0.0 if nesterov else rng.choice((0.0, 0.1)),
                 nesterov=nesterov, weight_decay=wd, maximize=maximize)
    elif kind in ("Adam", "AdamW"):
        h = dict(lr=rng.choice((1e-2, 3e-3)), betas=betas, eps=rng.choice((1e-8, 1e-6)), weight_decay=wd,
                 amsgrad=rng.random() < 0.4, maximize=maximize)
        if kind == "Adam" and rng.random() < 0.3:
            h["decoupled_weight_decay"] = True
    elif kind == "RMSprop":
        h = dict(lr=rng.choice((1e-2, 3e-3)), alpha=rng.choice((0.99, 0.9)), momentum=rng.choice((0.0, 0.9)),
                 centered=rng.random() < 0.4, weight_decay=wd, maximize=maximize, eps=rng.choice((1e-8, 1e-6)))
    elif kind == "Adagrad":
        h = dict(lr=rng.choice((1e-1, 1e-2)), lr_decay=rng.choice((0.0, 0.01)), weight_decay=wd,
                 initial_accumulator_value=rng.choice((0.0, 0.1)), maximize=maximize)
    elif kind == "Muon":
        h = dict(lr=rng.choice((2e-2, 1e-3)), weight_decay=rng.choice((0.0, 0.1)), momentum=rng.choice((0.95, 0.9)),
                 nesterov=rng.random() < 0.6, adjust_lr_fn=rng.choice((None, "original", "match_rms_adamw")))
    elif kind == "Lion":
        h = dict(lr=rng.choice((1e-3, 1e-4)), betas=[betas[0], 0.99], weight_decay=wd)
    elif kind == "Adamax":
        h = dict(lr=rng.choice((2e-3, 1e-2)), betas=betas, weight_decay=wd, maximize=maximize)
    elif kind == "NAdam":
        h = dict(lr=rng.choice((2e-3, 1e-2)), betas=betas, weight_decay=wd, maximize=maximize,
                 momentum_decay=rng.choice((0.004, 0.01)), decoupled_weight_decay=rng.random() < 0.4)
    elif kind == "RAdam":
        h = dict(lr=rng.choice((1e-3, 1e-2)), betas=betas, weight_decay=wd, maximize=maximize,
                 decoupled_weight_decay=rng.random() < 0.4)
    elif kind == "Adadelta":
        h = dict(lr=rng.choice((1.0, 0.5)), rho=rng.choice((0.9, 0.95)), weight_decay=wd, maximize=maximize)
    elif kind == "Rprop":
        h = dict(lr=rng.choice((1e-2, 1e-3)), etas=[rng.choice((0.5, 0.3)), rng.choice((1.2, 1.5))],
                 step_sizes=[1e-6, rng.choice((50.0, 1.0))], maximize=maximize)
    elif kind == "Adafactor":
        h = dict(lr=rng.choice((1e-2, 1e-3)), beta2_decay=rng.choice((-0.8, -0.5)),
                 eps=[rng.choice((None, 1e-30)), 1e-3], d=rng.choice((1.0, 2.0)), weight_decay=wd, maximize=maximize)
    if kind in FOREACH_EXACT and rng.random() < 0.3:
        h["foreach"] = True
    return {"kind": kind, "hyper": h}


# ------------------------------------------------------------------------------------------ the setup
def build(spec: dict):
    """(model, make_opts(model) -> ([optimizers], [schedulers]), loss_fn, batches): the model seeded."""
    if spec.get("hf"):
        return build_hf(spec)
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    D, B, K, T, V = spec["width"], spec["batch"], 3, 3, 7
    if spec.get("tie"):
        K = V  # the head is the embedding, tied
    act_of = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh, "mish": nn.Mish,
              "hardswish": nn.Hardswish, "elu": nn.ELU, "leaky_relu": lambda: nn.LeakyReLU(0.1),
              "softplus": nn.Softplus, "sigmoid": nn.Sigmoid}
    dtype = torch.float64 if spec.get("float64") else torch.bfloat16 if spec.get("bf16") else torch.float32
    S = 4 if spec["front"] == "conv2d" else T  # the stream's sequence length

    def attn_mask(kind):
        if kind == "bool":  # a fixed, non-causal pattern (each query sees itself)
            return torch.tensor([[True, False, True, False], [True, True, False, False], [False, True, True, True],
                                 [True, False, True, True]])[:S, :S] | torch.eye(S, dtype=torch.bool)
        if kind == "float":
            return torch.linspace(-1.0, 1.0, S * S).reshape(S, S)
        return None

    class Sdpa(nn.Module):
        def __init__(self, b):
            super().__init__()
            self.b, self.qkv, self.out = b, nn.Linear(D, 3 * D), nn.Linear(D, D)
            m = attn_mask(b["mask"])
            self.register_buffer("mask", m if m is None or m.dtype == torch.bool else m.to(dtype))

        def forward(self, x):
            q, k, v = self.qkv(x).reshape(x.shape[0], S, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.b["mask"] == "causal",
                                               dropout_p=self.b["p"] if self.training else 0.0, scale=self.b["scale"])
            return self.out(o.transpose(1, 2).reshape(x.shape[0], S, D))

    class Mha(nn.Module):
        def __init__(self, b):
            super().__init__()
            self.b = b
            self.mha = nn.MultiheadAttention(D, 2, dropout=b["p"], bias=b["bias"], batch_first=True)
            m = (nn.Transformer.generate_square_subsequent_mask(S) if b["mask"] == "causal"
                 else None if b["mask"] == "none" else attn_mask(b["mask"]))
            if m is not None and m.dtype == torch.bool:
                m = ~m  # MultiheadAttention's bool mask marks what is NOT attended
            self.register_buffer("mask", m if m is None or m.dtype == torch.bool else m.to(dtype))

        def forward(self, x):
            o, w = self.mha(x, x, x, attn_mask=self.mask, need_weights=self.b["need_weights"],
                            is_causal=self.b["mask"] == "causal")
            return o if w is None else o + w.sum(-1, keepdim=True)

    class Rnn(nn.Module):
        def __init__(self, b):
            super().__init__()
            cls = nn.GRU if b["kind"] == "gru" else nn.LSTM
            self.rnn = cls(D, D // 2 if b["bi"] else D, num_layers=b["layers"], batch_first=True,
                           bidirectional=b["bi"], dropout=b["p"])

        def forward(self, x):
            return self.rnn(x)[0]

    class Chan(nn.Module):  # a [B, D, T] op on the [B, T, D] stream
        def __init__(self, b):
            super().__init__()
            k = b["kind"]
            self.b = b
            if k == "gn":
                self.m = nn.GroupNorm(b["groups"], D)
            elif k == "inorm":
                self.m = nn.InstanceNorm1d(D, affine=b["affine"], track_running_stats=b["track"])
            elif k == "convT":
                self.m = nn.ConvTranspose1d(D, D, 3, padding=1)
            elif k == "dwconv":
                self.m = nn.Conv1d(D, D, 3, padding=1, groups=D)
            else:
                op = b["op"]
                self.m = (nn.MaxPool1d(3, 1, 1) if op == "max" else nn.AvgPool1d(3, 1, 1) if op == "avg"
                          else nn.AvgPool1d(3, 1, 1, count_include_pad=False) if op == "avg_nopad"
                          else nn.LPPool1d(2, 2, 1) if op == "lp" else nn.AdaptiveAvgPool1d(2))

        def forward(self, x):
            y = self.m(x.transpose(1, 2))
            if y.shape[-1] != S:  # a pooling that shortens the sequence: back to S by repeating
                y = F.interpolate(y, size=S, mode="nearest")
            if self.b.get("drop"):
                y = F.dropout(y, self.b["drop"], self.training)
            return y.transpose(1, 2)

    class TLin(nn.Module):  # a weight Parameter stored transposed (non-contiguous)
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(D, D).div(D ** 0.5).t())
            self.bias = nn.Parameter(torch.zeros(D))

        def forward(self, x):
            return x @ self.w + self.bias

    class Tel(nn.Module):
        def __init__(self, b):
            super().__init__()
            self.b = b
            self.m = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=b["p"], activation=b["act"], batch_first=True,
                                                norm_first=b["norm_first"])
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(S) if b["causal"] else None)

        def forward(self, x):
            return self.m(x, src_mask=self.mask, is_causal=self.b["causal"])

    class ChanBN(nn.Module):  # BatchNorm over the feature (last) dim, of a [B, D] or [B, T, D] stream
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(D)

        def forward(self, x):
            return self.bn(x) if x.dim() == 2 else self.bn(x.transpose(1, 2)).transpose(1, 2)

    class Resid(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.fc, self.act = nn.Linear(D, D), act_of[act]()

        def forward(self, x):
            return x + self.act(self.fc(x))

    class Shared(nn.Module):  # two layers, one weight
        def __init__(self, act):
            super().__init__()
            self.a, self.b, self.act = nn.Linear(D, D), nn.Linear(D, D), act_of[act]()
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.act(self.a(x)))

    class BufScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.rand(D) + 0.5)

        def forward(self, x):
            return x * self.scale

    class Ema(nn.Module):  # a buffer written in forward
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(D))

        def forward(self, x):
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.detach().reshape(-1, D).mean(0), alpha=0.1)
            return x

    class Reuse(nn.Module):  # one Linear applied twice in a forward (ALBERT's shared layers)
        def __init__(self, act):
            super().__init__()
            self.fc, self.act = nn.Linear(D, D), act_of[act]()

        def forward(self, x):
            return self.fc(self.act(self.fc(x)))

    class Unused(nn.Module):  # a parameter the loss never reaches (a pooler), or reads under no_grad
        def __init__(self, b):
            super().__init__()
            self.b, self.fc, self.pooler = b, nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):
            y = self.fc(x)
            if self.b["nograd_read"]:
                with torch.no_grad():
                    s = self.pooler.weight.abs().mean() + 0.5
                y = y * s
            return y

    class NonPers(nn.Module):  # non-persistent buffers written and read in forward (not in the state_dict)
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()), persistent=False)
            self.register_buffer("running", torch.zeros(D), persistent=False)

        def forward(self, x):
            with torch.no_grad():
                self.count.add_(1)
                # under autocast x is bfloat16 and the buffer float32 (lerp_ refuses mixed dtypes), as a script would
                self.running.lerp_(x.detach().reshape(-1, D).mean(0).to(self.running.dtype), 0.25)
            return x * (1 + 0.01 * self.count) + self.running

    class TConst(nn.Module):  # plain tensor attributes (no buffer): constants of the program
        def __init__(self):
            super().__init__()
            self.c = torch.linspace(0.5, 1.5, D).to(dtype)
            self.shift = torch.tensor(0.25, dtype=dtype)

        def forward(self, x):
            return x * self.c + self.shift

    class BN2(nn.Module):  # BatchNorm variants over the feature dim
        def __init__(self, v):
            super().__init__()
            self.bn = (nn.BatchNorm1d(D, momentum=None) if v == "cumulative" else
                       nn.BatchNorm1d(D, affine=False) if v == "noaffine" else
                       nn.BatchNorm1d(D, track_running_stats=False) if v == "nostats" else nn.BatchNorm1d(D))
            if v == "eval":
                self.bn.running_mean.uniform_(-0.5, 0.5)
                self.bn.running_var.uniform_(0.5, 1.5)
                self.bn._eval_after = True  # a frozen BatchNorm in a training model (detectron's FrozenBN habit)

        def forward(self, x):
            return self.bn(x) if x.dim() == 2 else self.bn(x.transpose(1, 2)).transpose(1, 2)

    class Drop2(nn.Module):
        def __init__(self, b):
            super().__init__()
            self.v, self.p = b["variant"], b["p"]
            self.m = (nn.Dropout1d(self.p) if self.v == "d1" else nn.AlphaDropout(self.p) if self.v == "alpha"
                      else nn.FeatureAlphaDropout(self.p) if self.v == "falpha" else None)
            self.fc = nn.Linear(D, D) if self.v == "inplace" else None

        def forward(self, x):
            if self.v == "functional":
                return F.dropout(x, self.p, self.training)
            if self.v == "inplace":  # torchvision's habit: in-place dropout and ReLU on a Linear's output
                return F.relu(F.dropout(self.fc(x), self.p, self.training, inplace=True), inplace=True)
            if self.v == "d1" and x.dim() == 3:  # channels are the features: a transposed stream into dropout
                return self.m(x.transpose(1, 2)).transpose(1, 2)
            return self.m(x)

    class Cond(nn.Module):  # torch.cond on a data-dependent predicate; branches read parameters and a buffer
        wants_input = True

        def __init__(self, b):
            super().__init__()
            self.b, self.a, self.act = b, nn.Linear(D, D), act_of[b["act"]]()
            self.c = None if b["share"] else nn.Linear(D, D)
            self.gain = nn.Parameter(torch.rand(D) + 0.5)
            self.register_buffer("scale", torch.rand(D) + 0.5)

        def forward(self, h, x):
            b = self.b
            if b["pred"] == "input":  # the batch's own value: one branch in some steps, the other in others
                pred = x.sum() > 0 if x.is_floating_point() else x.sum() % 2 == 0
            elif b["pred"] == "hidden":
                pred = h.mean() > 0
            else:
                pred = h.flatten()[0] > 0
            if b["outside"]:
                h = self.act(self.a(h))
            other = self.c if self.c is not None else self.a

            def true_fn(u, *rest):
                y = self.act(self.a(u)) * self.scale
                return y + rest[0] if rest else y

            def false_fn(u, *rest):
                y = other(u) * self.gain
                if b["nested"]:
                    y = torch.cond(u.mean() > 0, lambda v: v * self.gain, lambda v: v - self.scale, (y,))
                return y - rest[0] if rest else y

            ops = (h, x.float().mean().to(h.dtype)) if b["two"] else (h,)
            return torch.cond(pred, true_fn, false_fn, ops)

    class Inplace(nn.Module):  # in-place ops on activations
        def __init__(self, b):
            super().__init__()
            self.op, self.fc, self.shift = b["op"], nn.Linear(D, D), nn.Parameter(torch.randn(D) * 0.1)

        def forward(self, h):
            y, op = self.fc(h), self.op
            if op == "add_":
                y.add_(h)
            elif op == "relu_":
                y.add_(self.shift)
                y.relu_()
            elif op == "masked_fill_":
                y.masked_fill_(h.detach() > 0.5, 0.0)
            elif op == "mul_":
                y.mul_(torch.sigmoid(h))
            elif op == "chain":
                y = y.mul_(0.5).add_(h).relu_()
            elif op == "slice":
                y[..., :2].mul_(2.0)
                y[..., -1:].add_(self.shift[:1])
            elif op == "clamp_":
                y.clamp_(-0.5, 0.5)
            else:  # mask_softmax: a data mask filled with the dtype's minimum before a softmax
                y = y.masked_fill_(h < -0.5, torch.finfo(y.dtype).min).softmax(-1) * D
            return y

    class Where(nn.Module):
        wants_input = True

        def __init__(self, b):
            super().__init__()
            self.op, self.fc, self.w = b["op"], nn.Linear(D, D), nn.Parameter(torch.rand(D) + 0.5)

        def forward(self, h, x):
            if self.op == "hidden":
                return torch.where(h > 0, self.fc(h), h * self.w)
            if self.op == "leaky":
                return torch.where(h > 0, h, 0.1 * h) + self.fc(h)
            if self.op == "pad":  # a padding mask from the tokens (id 0), else from the stream
                m = ((x != 0).unsqueeze(-1) if not x.is_floating_point() and x.shape == h.shape[:-1]
                     else h.detach().sum(-1, keepdim=True) > 0)
                return torch.where(m, self.fc(h), 0.0)
            return torch.where(self.w > 1.0, self.fc(h), h)  # a mask from a parameter's value, moving as it trains

    class Gather(nn.Module):  # indices from data
        wants_input = True

        def __init__(self, b):
            super().__init__()
            self.op, self.fc = b["op"], nn.Linear(D, D)
            self.table = nn.Parameter(torch.randn(5, D) * 0.5)
            self.emb = nn.Embedding(8, D)

        def forward(self, h, x):
            op = self.op
            idx = (h.detach().abs().sum(-1) * 3).long() % 5
            if op == "index_select":
                return h + self.table.index_select(0, idx.flatten()).view_as(h)
            if op == "embedding":
                return h + F.embedding(idx, self.table)
            perm = h.detach().argsort(dim=-1, stable=True)
            if op == "gather":
                return torch.gather(self.fc(h), -1, perm)
            if op == "scatter_add":  # colliding indices
                return torch.zeros_like(h).scatter_add(-1, perm // 2, self.fc(h)) + h
            if op == "take_along":
                return h * torch.take_along_dim(self.fc(h), h.detach().argmax(-1, keepdim=True), -1)
            # pos_cumsum: position ids from a padding mask (transformers' create_position_ids_from_input_ids)
            m = ((x != 0).long() if not x.is_floating_point() and x.shape == h.shape[:-1]
                 else (h.detach()[..., 0] > 0).long())
            return h + self.emb((m.cumsum(-1) * m) % 8)

    class Cum(nn.Module):
        def __init__(self, b):
            super().__init__()
            self.op, self.fc = b["op"], nn.Linear(D, D)

        def forward(self, h):
            y, op = self.fc(h), self.op
            d = 1 if h.dim() == 3 else -1  # over time, else over features
            if op == "cummean":
                n = torch.arange(1, y.shape[d] + 1, dtype=y.dtype)
                return y.cumsum(d) / (n.view(-1, 1) if h.dim() == 3 else n)
            if op == "cumsum_last":
                return torch.cumsum(y, -1) * 0.3
            if op == "logcumsumexp":
                return torch.logcumsumexp(y, d)
            if op == "cummax":
                return y.cummax(d).values + h
            return y.flip(d).cumsum(d).flip(d)  # revcumsum (discounted returns' shape)

    class PView(nn.Module):  # a Parameter viewed in forward
        def __init__(self, b):
            super().__init__()
            self.op = op = b["op"]
            r = D ** -0.5
            shape = {"slice": (D, 2 * D), "reshape": (D * D,), "fused_qkv": (3 * D, D), "unbind": (2, D, D),
                     "expand": (1,), "diag": (D, D), "strided": (2 * D, D)}[op]
            self.w = nn.Parameter(torch.randn(*shape) * r if op != "expand" else torch.rand(1) + 0.5)
            self.fc = nn.Linear(D, D) if op == "expand" else None

        def forward(self, h):
            op, w = self.op, self.w
            if op == "slice":
                return h @ w[:, :D] + F.silu(h @ w[:, D:])
            if op == "reshape":
                return h @ w.view(D, D)
            if op == "fused_qkv":
                q, k, v = w.chunk(3, 0)
                return F.linear(h, q) * torch.sigmoid(F.linear(h, k)) + F.linear(h, v)
            if op == "unbind":
                a, c = w.unbind(0)
                return F.linear(torch.tanh(F.linear(h, a)), c)
            if op == "expand":
                return self.fc(h) * w.expand(D)
            if op == "diag":
                return h * torch.diagonal(w) + F.linear(h, w.triu())
            return F.linear(h, w[::2]) + F.linear(h, w[1::2].t())

    class Ckpt(nn.Module):  # activation checkpointing (Hugging Face's gradient_checkpointing)
        def __init__(self, b):
            super().__init__()
            self.b, self.fc, self.fc2, self.act = b, nn.Linear(D, D), nn.Linear(D, D), act_of[b["act"]]()

        def inner(self, u):
            return self.fc2(F.dropout(self.act(self.fc(u)), self.b["p"], self.training))

        def forward(self, h):
            import torch.utils.checkpoint
            return h + torch.utils.checkpoint.checkpoint(self.inner, h, use_reentrant=self.b["reentrant"])

    class Glu(nn.Module):
        def __init__(self, b):
            super().__init__()
            self.op, self.fc, self.out = b["op"], nn.Linear(D, 2 * D), nn.Linear(D, D, bias=False)

        def forward(self, h):
            a, g = self.fc(h).chunk(2, -1)
            a = F.silu(a) if self.op == "swiglu" else F.gelu(a, approximate="tanh")
            return h + self.out(a * g)

    class Misc(nn.Module):
        def __init__(self, b):
            super().__init__()
            self.op, self.fc = b["op"], nn.Linear(D, D)
            self.w = nn.Parameter(torch.randn(D, D) * D ** -0.5)
            self.g = nn.Parameter(torch.rand(D) + 0.5)

        def forward(self, h):
            op = self.op
            if op == "normalize":
                return F.normalize(self.fc(h), dim=-1) * self.g
            if op == "einsum":
                return torch.einsum("...d,de->...e", h, self.w)
            if op == "softmax_mix":
                return h * torch.softmax(self.fc(h), -1) * D
            if op == "logsigmoid":
                return F.logsigmoid(self.fc(h)) + h
            u = h if h.dim() == 3 else h.unsqueeze(1)  # bmm_attn
            s = torch.bmm(u, self.fc(u).transpose(1, 2)) / D ** 0.5
            o = torch.bmm(s.softmax(-1), u) + u @ self.w
            return o if h.dim() == 3 else o.squeeze(1)

    def hf_mask(b, h):
        if b["mask"] != "causal":
            return None
        if b["attn"] == "sdpa":  # a boolean mask (True: attended), as transformers builds for sdpa
            return torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        return torch.full((S, S), torch.finfo(h.dtype).min, dtype=h.dtype).triu(1)[None, None]

    class HfLlama(nn.Module):  # transformers' LlamaDecoderLayer with its rotary embedding
        def __init__(self, b):
            super().__init__()
            import transformers
            from transformers.models.llama import modeling_llama as ml
            transformers.logging.set_verbosity_error()
            cfg = transformers.LlamaConfig(vocab_size=8, hidden_size=D, intermediate_size=2 * D, num_attention_heads=2,
                                           num_key_value_heads=b["kv"], head_dim=4, max_position_embeddings=16,
                                           attention_dropout=b["p"], attention_bias=b["bias"], rms_norm_eps=1e-6,
                                           bos_token_id=0, eos_token_id=0, pad_token_id=0)
            cfg._attn_implementation = b["attn"]
            self.b, self.layer, self.rot = b, ml.LlamaDecoderLayer(cfg, layer_idx=0), ml.LlamaRotaryEmbedding(cfg)

        def forward(self, h):
            pos = torch.arange(h.shape[1]).unsqueeze(0)
            cos, sin = self.rot(h, pos)
            return self.layer(h, attention_mask=hf_mask(self.b, h), position_ids=pos, position_embeddings=(cos, sin))

    class HfGpt2(nn.Module):  # transformers' GPT2Block (Conv1D projections, its own dropouts)
        def __init__(self, b):
            super().__init__()
            import transformers
            from transformers.models.gpt2 import modeling_gpt2 as mg
            transformers.logging.set_verbosity_error()
            cfg = transformers.GPT2Config(vocab_size=8, n_positions=16, n_embd=D, n_layer=1, n_head=2, n_inner=2 * D,
                                          activation_function=b["act"], resid_pdrop=b["p"], attn_pdrop=b["p"],
                                          embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
            cfg._attn_implementation = b["attn"]
            self.b, self.blk = b, mg.GPT2Block(cfg, layer_idx=0)

        def forward(self, h):
            out = self.blk(h, attention_mask=hf_mask(self.b, h))
            return out[0] if isinstance(out, tuple) else out

    WILD = {"cond": Cond, "inplace": Inplace, "where": Where, "gather": Gather, "cumsum": Cum, "pview": PView,
            "ckpt": Ckpt, "glu": Glu, "misc": Misc, "hf_llama": HfLlama, "hf_gpt2": HfGpt2}

    def block(b):
        k = b["kind"]
        if k in WILD:
            return WILD[k](b)
        if k == "reuse":
            return Reuse(b["act"])
        if k == "unused":
            return Unused(b)
        if k == "nonpers":
            return NonPers()
        if k == "tconst":
            return TConst()
        if k == "bn2":
            return BN2(b["variant"])
        if k == "drop2":
            return Drop2(b)
        if k == "linear":
            return nn.Linear(D, D)
        if k == "ln":
            return nn.LayerNorm(D)
        if k == "bn":
            return ChanBN()
        if k == "act":
            return act_of[b["act"]]()
        if k == "drop":
            return nn.Dropout(b["p"])
        if k == "resid":
            return Resid(b["act"])
        if k == "shared":
            return Shared(b["act"])
        if k == "bufscale":
            return BufScale()
        if k == "ema":
            return Ema()
        if k == "act2":
            return act_of[b["act"]]()
        if k == "rms":
            return nn.RMSNorm(D, eps=b["eps"], elementwise_affine=b["affine"])
        if k == "tlin":
            return TLin()
        if k == "sdpa":
            return Sdpa(b)
        if k == "mha":
            return Mha(b)
        if k in ("gru", "lstm"):
            return Rnn(b)
        if k in ("gn", "inorm", "convT", "pool", "dwconv"):
            return Chan(b)
        if k == "tel":
            return Tel(b)
        raise ValueError(k)

    front = spec["front"]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            if front in ("linear", "seqlin"):
                self.front = nn.Linear(5, D)
            elif front == "embed":
                self.front = nn.Embedding(V, D, padding_idx=0 if spec["padding_idx"] else None,
                                          scale_grad_by_freq=spec.get("scale_grad_by_freq", False))
            elif front == "conv1d":
                self.front = nn.Conv1d(3, D, 3, padding=1)
            else:
                self.front = nn.Conv2d(2, D, 3, padding=1)
            self.front_bn = ((nn.BatchNorm1d if front == "conv1d" else nn.BatchNorm2d)(D)
                             if spec["front_bn"] else None)
            self.blocks = nn.ModuleList(block(b) for b in spec["blocks"])
            self.head = nn.Linear(D, K, bias=not spec.get("tie"))
            if spec.get("tie"):
                self.head.weight = self.front.weight  # GPT-2's tied embedding and LM head

        def forward(self, x):
            h = self.front(x)
            if self.front_bn is not None:
                h = self.front_bn(h)
            if front.startswith("conv"):
                h = h.flatten(2).transpose(1, 2)
            for blk in self.blocks:
                h = blk(h, x) if getattr(blk, "wants_input", False) else blk(h)
            return self.head(h)

    torch.manual_seed(spec["model_seed"])
    model = Net().train().to(dtype)
    for mod in model.modules():
        if getattr(mod, "_eval_after", False):
            mod.eval()
    _freeze(model, spec["frozen"])

    g = torch.Generator().manual_seed(spec["data_seed"])

    def one_batch():
        if front == "linear":
            x = torch.randn(B, 5, generator=g)
        elif front == "seqlin":
            x = torch.randn(B, T, 5, generator=g)
        elif front == "embed":
            x = torch.randint(0, V, (B, T), generator=g)
        elif front == "conv1d":
            x = torch.randn(B, 3, T, generator=g)
        else:
            x = torch.randn(B, 2, 2, 2, generator=g)
        if x.is_floating_point():
            x = x.to(dtype)
        seq = () if front == "linear" else (T if front != "conv2d" else 4,)
        if spec["loss"] == "ce":
            y = torch.randint(0, K, (B, *seq), generator=g)
            if ce.get("ignore"):
                y = torch.where(torch.rand(y.shape, generator=g) < 0.3, torch.full_like(y, -100), y)
        elif spec["loss"] == "bce":
            y = torch.rand(B, *seq, K, generator=g).to(dtype)
        else:
            y = torch.randn(B, *seq, K, generator=g).to(dtype)
        return x, y

    ce = spec.get("ce", {})
    red = spec.get("reduction", "mean")
    cw = ((torch.tensor([0.5, 1.0, 2.0]) if K == 3 else torch.linspace(0.5, 2.0, K)).to(dtype)
          if ce.get("weight") else None)

    def loss_fn(m, x, y):
        if spec.get("autocast"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(x)
            out = out.float()
        else:
            out = m(x)
        reg = spec.get("reg")
        if spec["loss"] == "ce" and reg == "masked_mean":  # per-token losses, averaged over the non-pad targets
            lt = F.cross_entropy(out.reshape(-1, K), y.reshape(-1), weight=cw, reduction="none",
                                 label_smoothing=ce.get("label_smoothing", 0.0))
            keep = (y.reshape(-1) > 0).to(lt.dtype)
            return (lt * keep).sum() / keep.sum().clamp(min=1)
        if spec["loss"] == "ce":
            loss = F.cross_entropy(out.reshape(-1, K), y.reshape(-1), weight=cw, reduction=red,
                                   label_smoothing=ce.get("label_smoothing", 0.0))
        elif spec["loss"] == "bce":
            loss = F.binary_cross_entropy_with_logits(out, y, reduction=red)
        elif spec["loss"] == "huber":
            loss = F.huber_loss(out, y, reduction=red, delta=0.5)
        else:
            loss = F.mse_loss(out, y, reduction=red)
        if reg == "l2":  # an explicit L2 penalty over the trained parameters
            loss = loss + 1e-3 * sum(p.pow(2).sum() for p in m.parameters() if p.requires_grad)
        elif reg == "zloss":
            loss = loss + 1e-2 * torch.logsumexp(out.float(), -1).pow(2).mean()
        return loss

    calls = STEPS * spec.get("unroll", 1)
    batches = [[one_batch() for _ in range(spec["accumulate"])] for _ in range(calls + 1)]
    return model, loss_fn, batches


def build_hf(spec: dict):
    """(model, loss_fn, batches) of a whole Hugging Face model (``model_spec``), trained with its own loss."""
    import torch
    import transformers as T

    T.logging.set_verbosity_error()
    hf = spec["hf"]
    fam, L, p, V, S, B = hf["family"], hf["layers"], hf["p"], 16, hf["seq"], spec["batch"]
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common = dict(vocab_size=V, hidden_size=8, intermediate_size=16, num_hidden_layers=L, num_attention_heads=2,
                  max_position_embeddings=16)
    if fam == "gpt2":
        cfg = T.GPT2Config(vocab_size=V, n_positions=16, n_embd=8, n_layer=L, n_head=2, n_inner=16,
                           activation_function=hf["act"], resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, **ids)
        cls = T.GPT2LMHeadModel  # tied embedding and LM head
    elif fam in ("llama", "qwen2"):
        cfg = (T.LlamaConfig if fam == "llama" else T.Qwen2Config)(
            **common, num_key_value_heads=hf["kv"], head_dim=4, attention_dropout=p, rms_norm_eps=1e-6,
            tie_word_embeddings=hf["tie"], **ids)
        cls = T.LlamaForCausalLM if fam == "llama" else T.Qwen2ForCausalLM
    elif fam == "opt":
        cfg = T.OPTConfig(vocab_size=V, hidden_size=8, num_hidden_layers=L, ffn_dim=16, num_attention_heads=2,
                          max_position_embeddings=16, dropout=p, attention_dropout=p, word_embed_proj_dim=8,
                          tie_word_embeddings=hf["tie"], **ids)
        cls = T.OPTForCausalLM
    elif fam == "gpt_neox":
        cfg = T.GPTNeoXConfig(**common, rotary_pct=0.5, use_parallel_residual=hf["parallel"], hidden_dropout=p,
                              attention_dropout=p, tie_word_embeddings=hf["tie"], **ids)
        cls = T.GPTNeoXForCausalLM
    elif fam in ("bert_cls", "bert_mlm"):
        cfg = T.BertConfig(**common, hidden_dropout_prob=p, attention_probs_dropout_prob=p, type_vocab_size=2,
                           num_labels=hf.get("labels", 2), tie_word_embeddings=hf["tie"], pad_token_id=0)
        cls = T.BertForSequenceClassification if fam == "bert_cls" else T.BertForMaskedLM
    elif fam == "t5":
        cfg = T.T5Config(vocab_size=V, d_model=8, d_kv=4, d_ff=16, num_layers=L, num_decoder_layers=L, num_heads=2,
                         relative_attention_num_buckets=4, relative_attention_max_distance=8, dropout_rate=p,
                         feed_forward_proj=hf["ff"], tie_word_embeddings=hf["tie"], decoder_start_token_id=0,
                         pad_token_id=0, eos_token_id=2)
        cls = T.T5ForConditionalGeneration
    else:
        raise ValueError(fam)
    cfg._attn_implementation = hf["attn"]
    dtype = torch.float64 if spec.get("float64") else torch.bfloat16 if spec.get("bf16") else torch.float32
    torch.manual_seed(spec["model_seed"])
    model = cls(cfg).to(dtype).train()
    if hf["ckpt"]:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": hf["ckpt"] == "reentrant"},
            every_n_layers=hf.get("ckpt_every", 1))
    _freeze(model, spec["frozen"])

    g = torch.Generator().manual_seed(spec["data_seed"])

    def one_batch():
        x = torch.randint(3, V, (B, S), generator=g)
        am = torch.ones(B, S, dtype=torch.long)
        pad = hf["pad"] if hf["pad"] != "mixed" else ("right", "left")[int(torch.randint(0, 2, (), generator=g))]
        if pad != "none":  # each row its own padding length, 0 included: each batch's padding differs
            for r in range(B):
                k = int(torch.randint(0, S - 1, (), generator=g))
                if k:
                    am[r, S - k:] = 0 if pad == "right" else 1
                    if pad == "left":
                        am[r, :k] = 0
        x = torch.where(am.bool(), x, torch.zeros_like(x))  # pad id 0
        b = {"input_ids": x}
        if hf["mask"]:
            b["attention_mask"] = am
        if fam == "bert_cls":
            if hf.get("token_types"):
                b["token_type_ids"] = (torch.arange(S) >= S // 2).long().expand(B, S).clone()
            n = hf["labels"]
            b["labels"] = (torch.randn(B, generator=g).to(dtype) if n == 1 else torch.randint(0, n, (B,), generator=g))
            return b
        if fam == "bert_mlm":  # labels on the masked positions only
            m = (torch.rand(B, S, generator=g) < 0.4) & am.bool()
            m[:, 0] = True
            b["labels"] = torch.where(m, x, torch.full_like(x, -100))
            b["input_ids"] = torch.where(m, torch.full_like(x, 3), x)  # the [MASK] token
            return b
        y = torch.randint(3, V, (B, S), generator=g) if fam == "t5" else x.clone()
        y = torch.where(am.bool() | torch.tensor(fam == "t5"), y, torch.full_like(y, -100))
        if hf["ignore"]:
            y = torch.where(torch.rand(B, S, generator=g) < 0.3, torch.full_like(y, -100), y)
        b["labels"] = y
        return b

    keys = None

    def pack(b):
        nonlocal keys
        keys = list(b)
        if hf["batch"] == "tuple":
            return tuple(b.values())
        return (T.BatchEncoding(b) if hf["batch"] == "encoding" else b,)

    def forward_loss(m, b):
        if hf.get("autocast"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(**b).loss
        return m(**b).loss

    def loss_fn(m, *args):
        return forward_loss(m, dict(zip(keys, args)) if hf["batch"] == "tuple" else args[0])

    calls = STEPS * spec.get("unroll", 1)
    batches = [[pack(one_batch()) for _ in range(spec["accumulate"])] for _ in range(calls + 1)]
    return model, loss_fn, batches


def _freeze(model, frozen: list) -> None:
    """Parameters by index in ``named_parameters()`` order (indices past the end are ignored) stop requiring grad."""
    named = list(model.named_parameters())
    for i in frozen:
        if i < len(named):
            named[i][1].requires_grad_(False)


def make_opts(spec: dict, model):
    """([optimizers], [schedulers]) of ``model`` as the spec says (called on the model and on its eager copy)."""
    import torch

    import torch_ext.optim

    named = list(model.named_parameters())
    params = [p for i, (_, p) in enumerate(named) if i not in spec["excluded"]]
    kind, h = spec["opt"]["kind"], dict(spec["opt"]["hyper"])
    for key in ("betas", "etas", "step_sizes", "eps"):
        if isinstance(h.get(key), list):
            h[key] = tuple(h[key])
    cls = torch_ext.optim.Lion if kind == "Lion" else getattr(torch.optim, kind)
    if spec.get("tensor_lr"):
        h["lr"] = torch.tensor(h["lr"], dtype=torch.float64 if spec["tensor_lr"] == "f64" else torch.float32)

    def groups(ps, lr):
        if spec["groups"] == 2 and len(ps) >= 2:
            g2 = {"params": ps[1::2], "lr": lr * spec["group2"]["lr_scale"]}
            if spec["group2"]["wd"] is not None and "weight_decay" in h:
                g2["weight_decay"] = spec["group2"]["wd"]
            for k, v in spec["group2"].get("hyper", {}).items():
                g2[k] = tuple(v) if isinstance(v, list) else v
            return [{"params": ps[0::2]}, g2]
        return ps

    if kind == "Muon":
        mats = [p for p in params if p.dim() == 2]
        rest = [p for p in params if p.dim() != 2]
        opts = [cls(groups(mats, h["lr"]), **h)] if mats else []
        if rest:
            opts.append(torch.optim.AdamW(groups(rest, 1e-2), lr=1e-2))
    else:
        opts = [cls(groups(params, h["lr"]), **h)]
    scheds = []
    for o in opts:
        if spec["sched"] == "step":
            scheds.append(torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5))
        elif spec["sched"] == "lambda":
            scheds.append(torch.optim.lr_scheduler.LambdaLR(o, _lambda))
        elif spec["sched"] == "onecycle":
            scheds.append(torch.optim.lr_scheduler.OneCycleLR(
                o, max_lr=[g["lr"] * 4 for g in o.param_groups], total_steps=10,
                cycle_momentum=spec["cycle_momentum"] and ("momentum" in o.defaults or "betas" in o.defaults)))
        elif spec["sched"] is not None:
            scheds.append(_sched2(spec, o))
    for _ in range(spec.get("sched_pre", 0) if spec["sched"] != "plateau" else 0):  # stepped eagerly before the
        # build: the step starts there (ReduceLROnPlateau steps on a metric: the build refuses it by name)
        for sc in scheds:
            sc.step()
    return opts, scheds


def _sched2(spec: dict, o):
    """The schedulers of ``real_spec`` (seeds >= REAL_SEED)."""
    import torch.optim.lr_scheduler as L

    k = spec["sched"]
    if k == "exp":
        return L.ExponentialLR(o, gamma=0.9)
    if k == "multistep":
        return L.MultiStepLR(o, milestones=[1, 3], gamma=0.5)
    if k == "cosine":
        return L.CosineAnnealingLR(o, T_max=4, eta_min=1e-4)
    if k == "cosine_wr":
        return L.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2, eta_min=1e-4)
    if k == "linear":
        return L.LinearLR(o, start_factor=0.25, total_iters=3)
    if k == "constant":
        return L.ConstantLR(o, factor=0.5, total_iters=2)
    if k == "poly":
        return L.PolynomialLR(o, total_iters=4, power=2.0)
    if k == "cyclic":
        lrs = [float(g["lr"]) for g in o.param_groups]
        return L.CyclicLR(o, base_lr=[x * 0.5 for x in lrs], max_lr=[x * 2 for x in lrs], step_size_up=2,
                          cycle_momentum=spec["cycle_momentum"] and ("momentum" in o.defaults or "betas" in o.defaults))
    if k == "sequential":
        return L.SequentialLR(o, [L.LinearLR(o, start_factor=0.5, total_iters=2), L.ExponentialLR(o, gamma=0.8)],
                              milestones=[2])
    if k == "chained":
        return L.ChainedScheduler([L.ExponentialLR(o, gamma=0.9), L.ConstantLR(o, factor=0.5, total_iters=2)])
    if k == "multiplicative":
        return L.MultiplicativeLR(o, _mult)
    if k == "plateau":
        return L.ReduceLROnPlateau(o)
    if k.startswith("hf_"):  # transformers' schedules (LambdaLRs of functools.partial lambdas)
        import transformers as T

        if k == "hf_linear":
            return T.get_linear_schedule_with_warmup(o, num_warmup_steps=2, num_training_steps=6)
        if k == "hf_cosine":
            return T.get_cosine_schedule_with_warmup(o, num_warmup_steps=1, num_training_steps=5)
        if k == "hf_cosine_restarts":
            return T.get_cosine_with_hard_restarts_schedule_with_warmup(o, 1, 6, num_cycles=2)
        if k == "hf_constant_warmup":
            return T.get_constant_schedule_with_warmup(o, num_warmup_steps=2)
        if k == "hf_poly":
            return T.get_polynomial_decay_schedule_with_warmup(o, 1, 5, lr_end=1e-7, power=2.0)
        if k == "hf_inverse_sqrt":
            return T.get_inverse_sqrt_schedule(o, num_warmup_steps=2)
    raise ValueError(k)


def _mult(i):
    return 0.95


def _lambda(i):
    return 1.0 / (1 + i)


# ------------------------------------------------------------------------------------------ one case
class Mismatch(AssertionError):
    pass


def _eq(a, b, what: str, diffs: list):
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            diffs.append(f"{what}: {type(a).__name__} vs eager {type(b).__name__}")
        elif a.shape != b.shape or a.dtype != b.dtype:
            diffs.append(f"{what}: {a.dtype}{list(a.shape)} vs eager {b.dtype}{list(b.shape)}")
        elif not torch.equal(a, b) and not (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                            and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))):
            d = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "?"
            diffs.append(f"{what}: max |diff| {d} (step {a.flatten()[:3].tolist()} vs eager {b.flatten()[:3].tolist()})")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _eq(x, y, f"{what}[{i}]", diffs)
    elif a != b:
        diffs.append(f"{what}: {a!r} vs eager {b!r}")


@one_intra_op_thread
def run_case(spec: dict, step: bool = True) -> list[str]:
    """Trains the spec both ways; returns the differences (empty: bit-exact). Refusals raise. ``step=False``:
    eager only (what _fuzz_driver.classify asks when the step failed: does eager train?), returning []."""
    import torch

    import torch_ext

    _fuzz_driver.enter("eager")  # the setup both sides share
    model, loss_fn, batches = build(spec)
    if spec.get("pre_grad"):  # an eager warm-up backward leaves .grad (BatchNorm statistics move too, both sides)
        torch.manual_seed(12345)
        loss_fn(model, *batches[0][0]).backward()
        named = list(model.named_parameters())
        for i in spec.get("freeze_after", []):
            if i < len(named):
                named[i][1].requires_grad_(False)  # frozen while holding a gradient
        if spec["pre_grad"] != "stale":
            model.zero_grad(set_to_none=spec["pre_grad"] == "none")
    ref = copy.deepcopy(model)
    for p, rp in zip(model.parameters(), ref.parameters()):
        rp.grad = None if p.grad is None else p.grad.clone()  # Parameter.__deepcopy__ drops .grad
    opts, scheds = make_opts(spec, model)
    ref_opts, ref_scheds = make_opts(spec, ref)
    n, u = spec["accumulate"], spec.get("unroll", 1)
    diffs: list[str] = []
    losses, new_lrs = (run_step(spec, model, loss_fn, batches, opts, scheds, diffs) if step else
                       (None, [g["lr"] * 0.3 for o in ref_opts for g in o.param_groups]))
    _fuzz_driver.enter("eager")

    torch.manual_seed(spec["rng_seed"])
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    for i, mbs in enumerate(batches[1:]):
        if spec.get("set_lr") and i == u:  # the eager twin of state.set_lr before the second call
            for g, lr in zip([g for o in ref_opts for g in o.param_groups], new_lrs):
                g["lr"] = lr
        for o in ref_opts:
            o.zero_grad(set_to_none=spec.get("pre_grad") != "zero")
        ls = []
        for mb in mbs:
            lo = loss_fn(ref, *mb)
            (lo / n if n > 1 else lo).backward()
            ls.append(lo.detach())
        if spec["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(ref_params, spec["clip"])
        for o in ref_opts:
            o.step()
        for s in ref_scheds:
            s.step()
        if step:
            _eq(losses[i], torch.stack(ls) if n > 1 else ls[0], f"loss step {i}", diffs)
    _fuzz_driver.enter("compare")
    if not step:
        return []
    ref_sd = ref.state_dict()
    for k, v in model.state_dict().items():
        _eq(v, ref_sd[k], f"model {k}", diffs)
    ref_bufs = dict(ref.named_buffers())
    for k, v in model.named_buffers():  # non-persistent buffers are in no state_dict
        if k not in ref_sd:
            _eq(v, ref_bufs[k], f"model buffer {k}", diffs)
    for oi, (o, ro) in enumerate(zip(opts, ref_opts)):
        names = {id(p): k for k, p in model.named_parameters()}
        for gi, (g, rg) in enumerate(zip(o.param_groups, ro.param_groups)):
            for key in g:
                if key != "params":
                    _eq(g[key], rg[key], f"opt{oi} group{gi} {key}", diffs)
            for p, rp in zip(g["params"], rg["params"]):
                st, rst = o.state.get(p, {}), ro.state.get(rp, {})
                if set(st) != set(rst):
                    diffs.append(f"opt{oi} state of {names[id(p)]}: slots {sorted(st)} vs eager {sorted(rst)}")
                for slot in set(st) & set(rst):
                    a, b = st[slot], rst[slot]
                    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype != b.dtype and a.dim() == 0:
                        a = a.to(b.dtype)  # a step counter kept as float32 where eager holds another dtype
                    _eq(a, b, f"opt{oi} state {names[id(p)]}.{slot}", diffs)
    for si, (s, rs) in enumerate(zip(scheds, ref_scheds)):
        for j, (m, rm) in enumerate(zip(getattr(s, "_schedulers", [s]), getattr(rs, "_schedulers", [rs]))):
            _eq(m.last_epoch, rm.last_epoch, f"sched{si}[{j}] last_epoch", diffs)  # ChainedScheduler: its members'
        _eq(s.get_last_lr(), rs.get_last_lr(), f"sched{si} last_lr", diffs)
    return diffs


def run_step(spec: dict, model, loss_fn, batches, opts, scheds, diffs: list) -> tuple[list, list]:
    """Trains the spec through the step (writing back into ``model`` and the optimizers); returns its losses and
    the lrs ``set_lr`` gave it. ``spec["save"]``: the saved program too, its differences from the live step
    appended to ``diffs``."""
    import torch_ext

    n, u = spec["accumulate"], spec.get("unroll", 1)
    opt_arg = opts if len(opts) > 1 else opts[0]
    sched_arg = (scheds if len(scheds) > 1 else scheds[0]) if scheds else None
    _fuzz_driver.enter("build")
    step = torch_ext.make_train_step(model, opt_arg, loss_fn, batches[0][0], clip_grad_norm=spec["clip"],
                                     accumulate=n, scheduler=sched_arg, unroll=u)
    runner = step
    if spec["runner"] == "plan":
        runner = step.compile(plan=True, donate=False)
    elif spec["runner"] == "donate":
        runner = step.compile(plan=True, donate=True)
    elif spec["runner"] == "budget":
        donate = spec["model_seed"] % 2 == 0
        try:
            runner = step.compile(plan=True, donate=donate, memory_budget=spec["budget"])
        except ValueError as e:  # out of reach for a tiny model (its state dominates): the smallest peak found,
            least = re.search(r"at least (\d+) bytes", str(e))  # which recomputes the most
            if least is None:
                raise
            runner = step.compile(plan=True, donate=donate, memory_budget=int(least.group(1)))
    state = step.init_state(seed=spec["rng_seed"])
    saved_state = step.init_state(seed=spec["rng_seed"]) if spec.get("save") else None
    fresh_scheds = make_opts(spec, copy.deepcopy(model))[1] if spec.get("save") and scheds else []
    new_lrs = [g["lr"] * 0.3 for o in opts for g in o.param_groups]
    _fuzz_driver.enter("run")
    losses, states = [], []
    for c in range(STEPS):
        if spec.get("set_lr") and c == 1:
            state.set_lr(new_lrs)
        calls = batches[1 + c * u:1 + (c + 1) * u]
        out = runner(state, *[t for mbs in calls for mb in mbs for t in mb])
        loss, state = out[0], out[1]
        losses.extend(loss.unbind(0) if u > 1 else [loss])
    if spec.get("save"):
        _saved_program(spec, step, saved_state, fresh_scheds, batches, losses, state, new_lrs, diffs)
    step.write_back(state)
    return losses, new_lrs


def _saved_program(spec: dict, step, state, scheds, batches, losses, live_state, new_lrs, diffs: list) -> None:
    """What a user deploys: ``torch.export.save(step.program, path)``, ``torch_ext.load_step(path)`` (with fresh
    schedulers where the step has them) trained over the same calls from the same initial state; its losses and
    final state must equal the live step's bit for bit (the live step equals eager, compared after this)."""
    import tempfile

    import torch

    import torch_ext

    u = spec.get("unroll", 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step.pt2")
        torch.export.save(step.program, path)
        loaded = torch_ext.load_step(path, scheduler=(scheds if len(scheds) > 1 else scheds[0]) if scheds else None)
        got = []
        for c in range(STEPS):
            if spec.get("set_lr") and c == 1:
                state.set_lr(new_lrs)
            calls = batches[1 + c * u:1 + (c + 1) * u]
            loss, state = loaded(state, *[t for mbs in calls for mb in mbs for t in mb])
            got.extend(loss.unbind(0) if u > 1 else [loss])
    for i, (a, b) in enumerate(zip(got, losses)):
        _eq(a, b, f"saved program: loss step {i}", diffs)
    for part in ("params", "buffers", "opt"):
        live = getattr(live_state, part)
        for k, v in getattr(state, part).items():
            _eq(v, live.get(k), f"saved program: state.{part}[{k}]", diffs)
    _eq(list(state.lr), list(live_state.lr), "saved program: state.lr", diffs)
    _eq(state.sched_epoch, live_state.sched_epoch, "saved program: state.sched_epoch", diffs)
    _eq(state.rng, live_state.rng, "saved program: state.rng", diffs)


def classify(exc: BaseException, spec: dict | None = None) -> tuple[str, str]:
    return _fuzz_driver.classify(exc, lambda line: line[:300], mismatch=(Mismatch,),
                                 eager=None if spec is None else lambda: _eager_raises(spec))


def _eager_raises(spec: dict) -> BaseException | None:
    """What eager training of ``spec`` alone raises (None: it trains)."""
    try:
        run_case(spec, step=False)
    except Exception as exc:  # noqa: BLE001 - any failure of eager's
        return exc
    return None


def simplifications(spec: dict):
    """Each one-step simpler variant of ``spec`` (for --minimize)."""
    hf = spec.get("hf")
    if hf:  # a whole Hugging Face model: its blocks and front are not used
        plain_hf = {"layers": 1, "p": 0.0, "attn": "sdpa", "pad": "none", "mask": False, "ignore": False,
                    "ckpt": None, "ckpt_every": 1, "batch": "tuple", "tie": False, "autocast": False, "seq": 4,
                    "token_types": False, "kv": 2, "parallel": False, "act": "gelu_new", "ff": "relu"}
        for key, v in plain_hf.items():
            if key in hf and hf[key] != v:
                yield {**spec, "hf": {**hf, key: v}}
        if spec["batch"] != 1:
            yield {**spec, "batch": 1}
    for k in range(len(spec["blocks"]) if not hf else 0):
        yield {**spec, "blocks": spec["blocks"][:k] + spec["blocks"][k + 1:]}
    plain = {"front_bn": False, "padding_idx": False, "frozen": [], "excluded": [], "groups": 1, "sched": None,
             "accumulate": 1, "clip": None, "runner": "exec", "batch": 4, "loss": "ce", "width": 4,
             "float64": False, "unroll": 1, "set_lr": False, "reduction": "mean", "scale_grad_by_freq": False,
             "ce": {}, "tie": False, "sched_pre": 0, "pre_grad": None, "freeze_after": [], "bf16": False,
             "autocast": False, "tensor_lr": None, "reg": None, "save": False}
    if hf:  # the batch is tried above, down to 1; the model's own keys do not apply to a whole model
        for key in ("batch", "front_bn", "padding_idx", "loss", "width", "reduction", "scale_grad_by_freq", "ce",
                    "tie", "autocast", "reg"):
            plain.pop(key)
    for key, v in plain.items():
        if spec.get(key, v) != v:
            yield {**spec, key: v}
    if spec["group2"].get("hyper"):
        yield {**spec, "group2": {k: v for k, v in spec["group2"].items() if k != "hyper"}}
    for key in spec["opt"]["hyper"]:
        if key != "lr":
            h = dict(spec["opt"]["hyper"])
            del h[key]
            yield {**spec, "opt": {**spec["opt"], "hyper": h}}
    if spec["opt"]["kind"] != "SGD":
        yield {**spec, "opt": {"kind": "SGD", "hyper": {"lr": 0.1}}}
    if hf:
        return
    seq_only = any(b["kind"] in SEQ_BLOCKS for b in spec["blocks"])
    for front in ("linear", "embed"):
        if spec["front"] != front and not (front == "linear" and seq_only):
            yield {**spec, "front": front, "front_bn": False, "padding_idx": False}


def minimize(spec: dict) -> dict:
    """Greedily simplifies ``spec`` while it stays a finding of the same status."""
    return _fuzz_driver.minimize(spec, one, simplifications, keep=lambda cand: not (
        cand["front"] == "linear" and cand["batch"] == 1 and any(b["kind"] == "bn" for b in cand["blocks"])))


def case_spec(seed: int, i: int) -> dict:
    rng = random.Random(f"{seed}:{i}")
    spec = gen_spec(rng)
    spec = extend_spec(spec, rng) if seed >= EXTENDED_SEED else spec
    spec = real_spec(spec, rng) if seed >= REAL_SEED else spec
    spec = wild_spec(spec, rng) if seed >= WILD_SEED else spec
    spec = model_spec(spec, rng) if seed >= MODEL_SEED else spec
    if os.environ.get("FUZZ_STEP_SAVE") == "1":  # any seed's cases through the saved program too
        spec["save"] = True
    return spec


def one(spec: dict) -> dict:
    try:
        diffs = run_case(spec)
        if diffs:
            return {"status": "mismatch", "msg": "\n".join(diffs[:20])}
        return {"status": "ok"}
    except Exception as exc:  # noqa: BLE001 - every exception is classified
        status, msg = classify(exc, spec)
        return {"status": status, "msg": msg}


def main(argv=None):
    return _fuzz_driver.main(argv, doc=__doc__, script=__file__, case_spec=case_spec, one=one, minimize=minimize,
                             case_timeout=120.0)


if __name__ == "__main__":
    sys.exit(main())
