"""A plain in-memory float64 FeatCal, written straight from docs/featcal.md, for the tests
(`reference_featcal` for single-stack models, `reference_featcal_t5` for T5 encoder-decoders).

It holds every model whole, computes X_t explicitly, solves with torch.linalg.solve and shares no
code with featcal_core: the library's streaming implementation must reproduce it.
"""

from __future__ import annotations

import copy
import math
import sys

import torch
from torch import nn

D64 = torch.float64


class Family:
    """How the reference reaches into a full HF model (CLIPVisionModel, BertModel, or a Llama-layout
    *ForCausalLM: kind "llama", also for Mistral and Qwen2) or an open_clip VisionTransformer
    (kind "open_clip")."""

    def __init__(self, kind: str):
        self.kind = kind
        self.exempt = {
            "clip": ("self_attn.k_proj", "self_attn.v_proj"),
            "bert": ("attention.self.key", "attention.self.value"),
            "llama": (),
            "open_clip": ("attn.in_proj",),
        }[kind]
        self.pooled = kind != "llama"  # causal LMs: no pooled-token down-weighting

    def layers(self, model):
        if self.kind == "open_clip":
            return [_OpenCLIPBlockView(block) for block in model.transformer.resblocks]
        if self.kind == "llama":
            return model.model.layers
        return model.encoder.layers if self.kind == "clip" else model.encoder.layer

    def stem(self, model, inputs):
        if self.kind == "open_clip":
            return _open_clip_stem(model, inputs["pixel_values"].to(D64))
        if self.kind == "clip":
            return model.pre_layrnorm(model.embeddings(inputs["pixel_values"].to(D64)))
        ids = inputs["input_ids"]
        if self.kind == "llama":
            return model.model.embed_tokens(ids)
        return model.embeddings(input_ids=ids, token_type_ids=torch.zeros_like(ids))

    def run(self, layer, hidden, mask):
        if self.kind == "open_clip":
            return layer(hidden, mask)
        if self.kind == "clip":
            out = layer(hidden, None)
        elif self.kind == "llama":
            out = _run_decoder_layer(layer, hidden, mask)
        else:
            add = (1.0 - mask.to(D64))[:, None, None, :] * torch.finfo(D64).min
            out = layer(hidden, attention_mask=add)
        return out[0] if isinstance(out, tuple) else out


def _open_clip_stem(model, pixels):
    """open_clip VisionTransformer tokens: conv patches, class token first, positions, ln_pre."""
    patches = nn.functional.conv2d(pixels, model.conv1.weight, stride=model.conv1.stride)
    patches = patches.flatten(2).transpose(1, 2)
    cls = model.class_embedding.reshape(1, 1, -1).expand(patches.shape[0], 1, -1)
    return model.ln_pre(torch.cat([cls, patches], dim=1) + model.positional_embedding)


class _OpenCLIPBlockView(nn.Module):
    """An open_clip ResidualAttentionBlock seen with its packed q/k/v projection as a Linear,
    `attn.in_proj`, that shares the block's `attn.in_proj_weight` / `in_proj_bias` (loading this
    view's state dict writes into the block). nn.MultiheadAttention calls neither in_proj nor
    out_proj as a module, so the forward is written out here: every Linear and LayerNorm is called
    as a module and the capture hooks see its input."""

    def __init__(self, block):
        super().__init__()
        mha = block.attn
        self.heads = mha.num_heads
        self.ln_1, self.ln_2, self.mlp = block.ln_1, block.ln_2, block.mlp
        self.ls_1, self.ls_2 = block.ls_1, block.ls_2
        self.attn = nn.Module()
        self.attn.in_proj = nn.Linear(mha.embed_dim, 3 * mha.embed_dim, device="meta")
        self.attn.in_proj.weight, self.attn.in_proj.bias = mha.in_proj_weight, mha.in_proj_bias
        self.attn.out_proj = mha.out_proj

    def forward(self, hidden, mask):
        batch, seq, width = hidden.shape
        head = width // self.heads
        qkv = self.attn.in_proj(self.ln_1(hidden))
        q, k, v = (
            qkv[..., i * width : (i + 1) * width]
            .reshape(batch, seq, self.heads, head)
            .transpose(1, 2)
            for i in range(3)
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(head)
        scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, width)
        hidden = hidden + self.ls_1(self.attn.out_proj(context))
        return hidden + self.ls_2(self.mlp(self.ln_2(hidden)))


def _run_decoder_layer(layer, hidden, mask):
    """A Llama-layout decoder layer on right-padded tokens: rotary embeddings of positions
    0..S-1 from the family's own rotary module, causal mask with padded keys masked."""
    batch, seq = mask.shape
    module = sys.modules[type(layer).__module__]
    rotary_cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    positions = torch.arange(seq)[None].expand(batch, -1)
    cos_sin = rotary_cls(config=layer.self_attn.config)(hidden, positions)
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None]
    add = torch.zeros(allowed.shape, dtype=D64).masked_fill(~allowed, torch.finfo(D64).min)
    return layer(hidden, attention_mask=add, position_ids=positions, position_embeddings=cos_sin)


def _is_rms_norm(module) -> bool:
    """Scale-only RMS norms: the Llama-family *RMSNorm and T5's T5LayerNorm."""
    name = type(module).__name__
    return name.endswith("RMSNorm") or name == "T5LayerNorm"


def _weights(name: str, last: bool, mask: torch.Tensor, family: Family) -> torch.Tensor:
    w = mask.to(D64).clone()
    if last and family.pooled and name not in family.exempt:
        w[:, 1:] *= 0.01
    return w.reshape(-1)


def _captured(layer, run, *args):
    """(run(layer, *args), the input of every Linear and norm inside `layer` during that call, by
    module name)."""
    seen, hooks = {}, []
    for name, module in layer.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)) or _is_rms_norm(module):
            hooks.append(
                module.register_forward_pre_hook(
                    lambda m, a, name=name: seen.__setitem__(name, a[0].detach())
                )
            )
    try:
        out = run(layer, *args)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


def _capture(family, layer, hidden, mask):
    return _captured(layer, family.run, hidden, mask)


def _solve_block(before, base_layer, expert_layers, xs, xe, weights, alpha, rho, lam, eps):
    """The closed forms of docs/featcal.md for every Linear and norm of one block: `before` is the
    merged block before calibration, xs / xe the captured student / expert inputs by task and
    module name, weights(task, name) the flattened ω of that module's input tokens. Returns the new
    tensors by local name."""
    tasks = list(expert_layers)
    new = {}
    for name, module in before.named_modules():
        base_mod = base_layer.get_submodule(name)
        if isinstance(module, nn.Linear):
            d_in = module.in_features
            lhs = (lam + eps) * torch.eye(d_in, dtype=D64)
            rhs = lam * (rho * module.weight + (1 - rho) * base_mod.weight).T
            s_sum, bias_terms, mus_terms = 0.0, 0.0, 0.0
            for t in tasks:
                w = weights(t, name)
                x_s = xs[t][name].reshape(-1, d_in)
                x_t = alpha * xe[t][name].reshape(-1, d_in) + (1 - alpha) * x_s
                total = w.sum()
                c = (x_s * w[:, None]).T @ x_s / total
                x = (x_s * w[:, None]).T @ x_t / total
                s = 1.0 / max(float(torch.linalg.matrix_norm(c)), eps)
                expert_mod = expert_layers[t].get_submodule(name)
                lhs = lhs + s * c
                rhs = rhs + s * x @ expert_mod.weight.T
                mu_s = (x_s * w[:, None]).sum(0) / total
                mu_t = (x_t * w[:, None]).sum(0) / total
                s_sum += s
                if module.bias is not None:
                    bias_terms = bias_terms + s * (expert_mod.bias + expert_mod.weight @ mu_t)
                mus_terms = mus_terms + s * mu_s
            weight = torch.linalg.solve(lhs, rhs).T
            new[f"{name}.weight"] = weight
            if module.bias is not None:
                a_b = rho * module.bias + (1 - rho) * base_mod.bias
                bias = (bias_terms - weight @ mus_terms + lam * a_b) / (s_sum + lam)
                new[f"{name}.bias"] = bias
        elif _is_rms_norm(module):
            # scale only: γ = (Σ e_t γ_t + λ a(γ)) / (Σ e_t + λ), z = x / sqrt(mean(x²) + eps)
            d = module.weight.shape[0]
            num = lam * (rho * module.weight + (1 - rho) * base_mod.weight)
            den = torch.full((d,), lam, dtype=D64)
            for t in tasks:
                w = weights(t, name)
                x = xs[t][name].reshape(-1, d)
                z = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
                e_t = (z * z * w[:, None]).sum(0) / w.sum()
                expert_mod = expert_layers[t].get_submodule(name)
                num, den = num + e_t * expert_mod.weight, den + e_t
            new[f"{name}.weight"] = num / den
        elif isinstance(module, nn.LayerNorm):
            d = module.normalized_shape[0]
            a11 = torch.full((d,), lam, dtype=D64)
            a12 = torch.zeros(d, dtype=D64)
            r1 = lam * (rho * module.weight + (1 - rho) * base_mod.weight)
            r2 = lam * (rho * module.bias + (1 - rho) * base_mod.bias)
            for t in tasks:
                w = weights(t, name)
                z = nn.functional.layer_norm(xs[t][name].reshape(-1, d), (d,), eps=module.eps)
                m_t = (z * w[:, None]).sum(0) / w.sum()
                e_t = (z * z * w[:, None]).sum(0) / w.sum()
                expert_mod = expert_layers[t].get_submodule(name)
                a11, a12 = a11 + e_t, a12 + m_t
                r1 = r1 + e_t * expert_mod.weight + m_t * expert_mod.bias
                r2 = r2 + m_t * expert_mod.weight + expert_mod.bias
            a22 = torch.full((d,), len(tasks) + lam, dtype=D64)
            mats = torch.stack([torch.stack([a11, a12], -1), torch.stack([a12, a22], -1)], -2)
            sol = torch.linalg.solve(mats, torch.stack([r1, r2], -1))
            new[f"{name}.weight"], new[f"{name}.bias"] = sol[:, 0], sol[:, 1]
    return new


@torch.no_grad()
def reference_featcal(family, base, merged, experts, inputs, alpha, rho, lam, eps=1e-8):
    """Return the calibrated state dict (float64). experts/inputs: dicts keyed by task; inputs
    hold model inputs plus "attention_mask" (B, S) and optionally "weight_mask" (B, S), the token
    weights when they differ from the attention mask."""
    cal = copy.deepcopy(merged).to(D64)
    base, experts = base.to(D64), {t: m.to(D64) for t, m in experts.items()}
    tasks = list(experts)
    hs = {t: family.stem(cal, inputs[t]) for t in tasks}
    he = {t: family.stem(experts[t], inputs[t]) for t in tasks}
    n_layers = len(family.layers(cal))
    for index in range(n_layers):
        last = index == n_layers - 1
        layer = family.layers(cal)[index]
        before = copy.deepcopy(layer)
        base_layer = family.layers(base)[index]
        xs, xe = {}, {}
        for t in tasks:
            mask = inputs[t]["attention_mask"]
            _, xs[t] = _capture(family, before, hs[t], mask)
            expert_layer = family.layers(experts[t])[index]
            he[t], xe[t] = _capture(family, expert_layer, he[t], mask)
        expert_layers = {t: family.layers(experts[t])[index] for t in tasks}

        def weights(t, name, last=last):
            return _weights(
                name, last, inputs[t].get("weight_mask", inputs[t]["attention_mask"]), family
            )

        new = _solve_block(before, base_layer, expert_layers, xs, xe, weights, alpha, rho, lam, eps)
        layer.load_state_dict({**layer.state_dict(), **new})  # others (layer scale): as merged
        for t in tasks:
            hs[t] = family.run(layer, hs[t], inputs[t]["attention_mask"])
    return cal.state_dict()


# ----- T5 (T5ForConditionalGeneration: encoder then decoder; T5EncoderModel: encoder only) -------

#: decoder-block modules whose input is the encoder output (ω: the encoder tokens' mask)
T5_CROSS_KV = ("layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v")


def t5_inputs(tokenizer, texts, targets=None, max_length=128, start_id=0):
    """Model inputs of a T5 calibration batch: encoder ids/mask from `texts` (right padding,
    truncation), and teacher-forced decoder ids/mask: labels = tokenizer(targets) (with its eos),
    decoder ids = [start] + labels[:-1], decoder mask = the labels' mask; without targets
    the decoder input is the start token alone (mask 1)."""
    enc = tokenizer(
        list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    batch = enc["input_ids"].shape[0]
    start = torch.full((batch, 1), start_id, dtype=torch.long)
    one = torch.ones(batch, 1, dtype=torch.long)
    if targets is None:
        dec_ids, dec_mask = start, one
    else:
        labels = tokenizer(
            list(targets), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        dec_ids = torch.cat([start, labels["input_ids"][:, :-1]], dim=1)
        dec_mask = labels["attention_mask"]  # position j predicts label j: real label tokens
    return {
        "input_ids": enc["input_ids"],
        "attention_mask": enc["attention_mask"],
        "decoder_input_ids": dec_ids,
        "decoder_attention_mask": dec_mask,
    }


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=D64).masked_fill(~allowed, torch.finfo(D64).min)


def t5_masks(inputs) -> dict[str, torch.Tensor]:
    """Additive float64 attention masks: "encoder" (B, 1, 1, Se) padded keys; "decoder"
    (B, 1, Sd, Sd) causal plus padded keys; "cross" (B, 1, 1, Se) padded encoder keys."""
    enc = inputs["attention_mask"].bool()[:, None, None, :]
    masks = {"encoder": _additive(enc), "cross": _additive(enc)}
    if "decoder_attention_mask" in inputs:
        dec = inputs["decoder_attention_mask"].bool()
        causal = torch.ones(dec.shape[1], dec.shape[1], dtype=torch.bool).tril()
        masks["decoder"] = _additive(causal[None, None] & dec[:, None, None, :])
    return masks


def t5_position_bias(stack, length: int) -> torch.Tensor:
    """(1, heads, length, length) relative position bias of a T5Stack from its block 0's
    relative_attention_bias table (bidirectional buckets in the encoder, causal in the decoder:
    compute_bias follows the stack's is_decoder)."""
    attention = stack.block[0].layer[0].SelfAttention
    assert attention.has_relative_attention_bias and attention.is_decoder == stack.is_decoder
    return attention.compute_bias(length, length)


def t5_run_block(block, hidden, bias, mask, context=None, context_mask=None):
    """One HF T5Block with an explicit position bias and additive masks (decoder blocks: with the
    encoder context for cross-attention)."""
    out = block(
        hidden,
        attention_mask=mask,
        position_bias=bias,
        encoder_hidden_states=context,
        encoder_attention_mask=context_mask,
    )
    return out[0] if isinstance(out, tuple) else out


def _t5_eager(model):
    for module in model.modules():
        if type(module).__name__ == "T5Attention":
            module.config._attn_implementation = "eager"
    return model


def _t5_has_decoder(model) -> bool:
    return getattr(model, "decoder", None) is not None


@torch.no_grad()
def t5_hidden_states(model, inputs):
    """(encoder output, decoder output), each after its stack's final_layer_norm (decoder: None for
    a T5EncoderModel), by chaining the stems and t5_run_block as reference_featcal_t5 does."""
    _t5_eager(model)
    masks = t5_masks(inputs)
    hidden = model.shared(inputs["input_ids"])
    bias = t5_position_bias(model.encoder, hidden.shape[1])
    for block in model.encoder.block:
        hidden = t5_run_block(block, hidden, bias, masks["encoder"])
    context = model.encoder.final_layer_norm(hidden)
    if not _t5_has_decoder(model):
        return context, None
    hidden = model.shared(inputs["decoder_input_ids"])
    bias = t5_position_bias(model.decoder, hidden.shape[1])
    for block in model.decoder.block:
        hidden = t5_run_block(block, hidden, bias, masks["decoder"], context, masks["cross"])
    return context, model.decoder.final_layer_norm(hidden)


def _t5_stage(stack, cal, base, experts, inputs, hs, he, context, settings):
    """Calibrate the blocks of one stack ("encoder" or "decoder") of `cal` in forward order; hs /
    he: student / expert hidden states by task (updated in place); context: (student, expert)
    encoder outputs by task for the decoder's cross-attention, None for the encoder."""
    tasks = list(experts)
    decoder = stack == "decoder"
    masks = {t: t5_masks(inputs[t]) for t in tasks}
    self_mask = {t: masks[t][stack] for t in tasks}
    cross = {t: masks[t]["cross"] if decoder else None for t in tasks}
    token_mask = {
        t: inputs[t]["decoder_attention_mask" if decoder else "attention_mask"] for t in tasks
    }
    # each model's own table, block 0 of the same stack (the student's is never calibrated)
    bias_s = {t: t5_position_bias(getattr(cal, stack), hs[t].shape[1]) for t in tasks}
    bias_e = {t: t5_position_bias(getattr(experts[t], stack), he[t].shape[1]) for t in tasks}
    ctx_s = {t: context[0][t] if decoder else None for t in tasks}
    ctx_e = {t: context[1][t] if decoder else None for t in tasks}

    def weights(t, name):
        mask = inputs[t]["attention_mask"] if name in T5_CROSS_KV else token_mask[t]
        return mask.to(D64).reshape(-1)

    for index, layer in enumerate(getattr(cal, stack).block):
        before = copy.deepcopy(layer)
        expert_layers = {t: getattr(experts[t], stack).block[index] for t in tasks}
        xs, xe = {}, {}
        for t in tasks:
            student = (hs[t], bias_s[t], self_mask[t], ctx_s[t], cross[t])
            _, xs[t] = _captured(before, t5_run_block, *student)
            expert = (he[t], bias_e[t], self_mask[t], ctx_e[t], cross[t])
            he[t], xe[t] = _captured(expert_layers[t], t5_run_block, *expert)
        base_layer = getattr(base, stack).block[index]
        new = _solve_block(before, base_layer, expert_layers, xs, xe, weights, *settings)
        layer.load_state_dict({**layer.state_dict(), **new})  # relative_attention_bias: merged
        for t in tasks:
            hs[t] = t5_run_block(layer, hs[t], bias_s[t], self_mask[t], ctx_s[t], cross[t])


@torch.no_grad()
def reference_featcal_t5(base, merged, experts, inputs, alpha, rho, lam, eps=1e-8):
    """The calibrated state dict (float64) of a T5ForConditionalGeneration or T5EncoderModel:
    encoder blocks, then decoder blocks. inputs[t]: t5_inputs(...). Each stream runs with its own
    model's stems, tables and final encoder norm; the student's decoder context is the merged
    model's encoder.final_layer_norm of the calibrated encoder's output. Token weights: padding 0,
    real tokens 1; the decoder's EncDecAttention.k / .v weigh the encoder tokens."""
    cal = _t5_eager(copy.deepcopy(merged).to(D64))
    base = _t5_eager(base.to(D64))
    experts = {t: _t5_eager(m.to(D64)) for t, m in experts.items()}
    tasks = list(experts)
    settings = (alpha, rho, lam, eps)
    hs = {t: cal.shared(inputs[t]["input_ids"]) for t in tasks}
    he = {t: experts[t].shared(inputs[t]["input_ids"]) for t in tasks}
    _t5_stage("encoder", cal, base, experts, inputs, hs, he, None, settings)
    if _t5_has_decoder(cal):
        context = (
            {t: cal.encoder.final_layer_norm(hs[t]) for t in tasks},
            {t: experts[t].encoder.final_layer_norm(he[t]) for t in tasks},
        )
        hs = {t: cal.shared(inputs[t]["decoder_input_ids"]) for t in tasks}
        he = {t: experts[t].shared(inputs[t]["decoder_input_ids"]) for t in tasks}
        _t5_stage("decoder", cal, base, experts, inputs, hs, he, context, settings)
    return cal.state_dict()
