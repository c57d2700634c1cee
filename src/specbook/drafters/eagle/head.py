"""The EAGLE head: fc(2H -> H) over [token embedding; feature] + one decoder layer of the target's family
(+ final norm), with a fast path for drafting on Llama-family heads, and its checkpoint loader."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...models import cache_kw
from ...tree import additive_mask


def _head_config(target_config):
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[-1:]
    cfg.vocab_size = 1  # the head never embeds ids itself (inputs_embeds only): no 49k x H table
    cfg.pad_token_id = None
    cfg.tie_word_embeddings = False
    return cfg


class EagleHead(nn.Module):
    """fc(2H -> H) + one decoder layer (+ final norm) of the target's family. ~4.2M parameters for SmolLM2.

    ``bias`` / ``final_norm``: EAGLE has both; an MTP module (drafters/mtp.py) reuses this block as its
    projection M_k (no bias) + transformer block TRM_k, whose output is normed by the target's own final norm."""

    def __init__(self, target_config, bias: bool = True, final_norm: bool = True):
        super().__init__()
        from transformers import AutoModel

        H = target_config.hidden_size
        self.hidden = H
        self.fc = nn.Linear(2 * H, H, bias=bias)
        self.model = AutoModel.from_config(_head_config(target_config))
        if not final_norm:
            self.model.norm = nn.Identity()
        # drafting (a cache is given) on a Llama-family head skips transformers' model wrapper: see _cached_llama
        self.fast_path = target_config.model_type == "llama" and getattr(target_config, "hidden_act", "") == "silu"

    @property
    def config(self):
        """The one-layer config (what the draft KV cache is built for)."""
        return self.model.config

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """emb, feat [B, S, H] (e(x_{j+1}), f_j) -> predicted features f^_{j+1} [B, S, H]."""
        x = self.fc(torch.cat([emb, feat], dim=-1))
        if cache is not None and self.fast_path and position_ids is not None:
            return self._cached_llama(x, position_ids, attention_mask, cache)
        out = self.model(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                         **cache_kw(cache), use_cache=cache is not None)
        return out.last_hidden_state

    def _cached_llama(self, x: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache) -> torch.Tensor:
        """The same decoder layer, called module by module (its own norms, projections, rotary embedding, MLP
        and the cache's update; torch's sdpa), without transformers' model wrapper — mask building,
        output capture, deprecation and kwargs plumbing cost ~0.5 ms of a ~1.7 ms draft forward on a 2-core CPU
        and the head runs several times per step. Same operations in the same order: the output equals the
        wrapper's (tests/test_eagle.py checks it bit for bit). x [B, S, H] -> [B, S, H]."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer = self.model.layers[0]
        att = layer.self_attn
        B, S, _ = x.shape
        past = cache.get_seq_length()
        if attention_mask is None and S > 1:  # causal over the cache + the new block
            allowed = torch.ones(S, past + S, dtype=torch.bool, device=x.device).tril(past)
            attention_mask = additive_mask(allowed, x.dtype)[None, None]
        cos, sin = self.model.rotary_emb(x, position_ids=position_ids)
        h = layer.input_layernorm(x)
        shape = (B, S, -1, att.head_dim)
        q = att.q_proj(h).view(shape).transpose(1, 2)  # [B, nh, S, hd]
        k = att.k_proj(h).view(shape).transpose(1, 2)  # [B, nkv, S, hd]
        v = att.v_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = cache.update(k, v, 0)  # [B, nkv, past + S, hd]
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=att.scaling,
                                                       enable_gqa=k.shape[1] != q.shape[1])
        x = x + att.o_proj(o.transpose(1, 2).reshape(B, S, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def trainable_state(self) -> dict:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("model.embed_tokens")}


def load_eagle(target, path) -> tuple[EagleHead, torch.Tensor | None, dict]:
    """Head (on the target's device and dtype), its vocabulary and the card; refuses a checkpoint made
    for another target (fingerprint), another architecture / layer count, or a corrupt file."""
    from ...training import CheckpointError, load_checkpoint

    state, card = load_checkpoint(path, target=target, kind="eagle")
    c = card["config"]
    want = {"hidden_size": target.config.hidden_size, "num_hidden_layers_target": target.config.num_hidden_layers,
            "model_type": target.config.model_type}
    got = {k: c.get(k) for k in want}
    if got != want:
        raise CheckpointError(f"{path} is an EAGLE head for {got}, but this target is {want}; train one with "
                              "`python -m specbook.train eagle`")
    if c.get("inputs", "both") != "both":
        raise CheckpointError(f"{path} is a {c['inputs']!r}-only ablation head; drafting needs a head trained on "
                              "both inputs (inputs='both')")
    vocab = state.pop("vocab", None)
    head = EagleHead(target.config)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("model.embed_tokens")]:
        raise CheckpointError(f"{path}: weights do not match an EAGLE head for this target "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    W = target.get_output_embeddings().weight
    head.to(device=W.device, dtype=W.dtype).eval()
    return head, (None if vocab is None else vocab.to(W.device)), card
