"""EAGLE-1's training objective (feature regression + soft cross-entropy through the frozen LM head) and
the teacher-forced top-1 probe notebook 03 uses."""

from __future__ import annotations

import torch
from torch import nn

from .. import head_rows, with_vocab
from .head import EagleHead


class EagleObjective:
    """EAGLE-1 training with the frozen target: 1.0 * SmoothL1(f^, f) + 0.1 * soft-CE(p_target, q).

    Batch positions j = 0..S-2: input (e(x_{j+1}), f_j + noise), regression target f_{j+1}, teacher
    p = softmax(f_{j+1} @ W^T) over the head vocabulary. Loss where f_{j+1} predicts a response token.
    """

    kind = "eagle"

    INPUTS = ("both", "token", "feature")

    def __init__(self, target, vocab: torch.Tensor | None = None, noise: float = 0.1, w_feat: float = 1.0,
                 w_token: float = 0.1, feature_index: int = 0, seed: int = 0, inputs: str = "both"):
        """``inputs``: "both" (EAGLE), or an ablation that zeroes one input — "token" (no feature: a one-layer
        draft LM over token embeddings) or "feature" (no shifted token: EAGLE's feature-only variant)."""
        if inputs not in self.INPUTS:
            raise ValueError(f"inputs must be one of {self.INPUTS}, got {inputs!r}")
        self.inputs = inputs
        W, vocab = head_rows(target.get_output_embeddings().weight, vocab)
        self.vocab = None if vocab is None else vocab.cpu()
        self.W = W.detach().float()  # [Vd, H] frozen
        self.W_full = target.get_output_embeddings().weight.detach().float()
        self.E = target.get_input_embeddings()  # frozen; called as a module (keeps any embedding scale)
        self.head = EagleHead(target.config).to(self.W.device).float()
        self.module = self.head
        self.noise, self.w_feat, self.w_token, self.fi = noise, w_feat, w_token, feature_index
        self.config = target.config
        self._g = torch.Generator(device=self.W.device).manual_seed(seed)

    def _emb(self, ids):
        with torch.no_grad():
            return self.E(ids).float()

    def _predict(self, batch, noise: float, feats=None):
        f = batch.feats[:, :, self.fi, :].float() if feats is None else feats  # [B, S, H]
        f_in = f[:, :-1]
        if noise:
            f_in = f_in + (torch.rand(f_in.shape, generator=self._g, device=f_in.device) * 2 - 1) * noise
        e = self._emb(batch.tokens[:, 1:])
        if self.inputs == "token":
            f_in = torch.zeros_like(f_in)
        elif self.inputs == "feature":
            e = torch.zeros_like(e)
        return self.head(e, f_in)  # [B, S-1, H]

    def loss(self, batch):
        pred = self._predict(batch, self.noise)
        tgt = batch.feats[:, 1:, self.fi, :].float()
        m = batch.mask[:, 1:]
        pred, tgt = pred[m], tgt[m]  # [M, H]
        feat_loss = nn.functional.smooth_l1_loss(pred.float(), tgt)
        q_logits = pred @ self.W.T.to(pred.dtype)
        with torch.no_grad():
            p = torch.softmax(tgt @ self.W.T, -1)
        ce = -(p * torch.log_softmax(q_logits.float(), -1)).sum(-1).mean()
        top1 = float((q_logits.argmax(-1) == p.argmax(-1)).float().mean())
        return self.w_feat * feat_loss + self.w_token * ce, {"feat_l1": float(feat_loss.detach()), "ce": float(ce.detach()),
                                                             "top1": top1}

    def _hits(self, pred, tgt, topk: int):
        """-> hit [M, topk] (the head's c-th guess is the target's greedy token), p_top [M, topk] (the target's
        T = 1 probability of the c-th guess: the chance a one-hot pick of it is accepted when sampling) and
        conf [M] (the draft's own probability of its top guess, softmax over the head vocabulary as drafting
        computes it)."""
        logits = tgt @ self.W_full.T  # [M, V] the target's logits (full vocabulary)
        q_logits = pred @ self.W.T  # [M, Vd] the draft's logits (head vocabulary)
        v, top = q_logits.topk(topk, -1)
        conf = (v[:, 0].float() - q_logits.float().logsumexp(-1)).exp()
        if self.vocab is not None:
            top = self.vocab.to(top.device)[top]
        return top == logits.argmax(-1)[:, None], torch.softmax(logits, -1).gather(-1, top), conf

    @torch.no_grad()
    def evaluate(self, batch, topk: int = 10):
        """Held-out: rank accuracies of the drafted token against the target's greedy token.

        step 1: the head reads the target's true features (the first draft token of every step).
        step 2: every input feature replaced by the head's own step-1 prediction (what deeper draft
        tokens see): how much error compounds when the head drafts on its own features.
        """
        res = {}
        f = batch.feats[:, :, self.fi, :].float()
        m = batch.mask[:, 1:]
        pred1 = self._predict(batch, 0.0)  # [B, S-1, H]: f^_{j+1}
        hit, p_top, conf = self._hits(pred1[m], f[:, 1:][m], topk)
        res["top1"] = float(hit[:, 0].float().mean())
        res[f"top{topk}"] = float(hit.any(-1).float().mean())
        for c in range(topk):
            res[f"acc_r{c}"] = float(hit[:, c].float().mean())
        for c in range(topk):  # what a static tree's rank-c child is worth when the loop samples at T = 1
            res[f"soft_r{c}"] = float(p_top[:, c].mean())
        # the draft's confidence in its top-1 guess: against top1 it says how far EAGLE-2's confidence-as-acceptance
        # estimate is off (confidence_calibration)
        res["conf_r0"] = float(conf.mean())
        res["feat_l1"] = float(nn.functional.smooth_l1_loss(pred1[m], f[:, 1:][m]))
        # step 2: inputs (e(x_{j+2}), f^_{j+1}) -> f^_{j+2}, scored against f_{j+2}
        f2 = torch.cat([f[:, :1], pred1], dim=1)  # position j holds f^_j (j >= 1)
        pred2 = self._predict(batch, 0.0, feats=f2)
        m2 = m.clone()
        m2[:, 0] = False  # position 0 has no predicted input
        hit2, _, _ = self._hits(pred2[m2], f[:, 1:][m2], 1)
        res["top1_step2"] = float(hit2[:, 0].float().mean())
        res["mean_top1"] = 0.5 * (res["top1"] + res["top1_step2"])
        return res

    def card_config(self) -> dict:
        return {"hidden_size": self.config.hidden_size, "num_hidden_layers_target": self.config.num_hidden_layers,
                "model_type": self.config.model_type, "noise": self.noise, "w_feat": self.w_feat,
                "w_token": self.w_token, "inputs": self.inputs,
                "vocab_size": None if self.vocab is None else int(len(self.vocab))}

    def state(self) -> dict:
        return with_vocab(self.head.trainable_state(), self.vocab)


@torch.inference_mode()
def teacher_forced_top1(target, head: EagleHead, vocab: torch.Tensor | None, tokens: list[int]) -> torch.Tensor:
    """hit [len(tokens)] bool: hit[t] = the head's top-1 guess for token t — reading the target's true features
    f_0..f_{t-2} and tokens up to t-1, as the first draft token of a step that starts with t-1 committed —
    equals the target's greedy token at t (hit[0] = hit[1] = False: no guess there).

    Averaged over every position this is the held-out top-1 of training; averaged over the positions where
    speculation steps actually started it is the first draft token's acceptance in the loop (T = 0)."""
    W, vocab = head_rows(target.get_output_embeddings().weight, vocab)
    dev = W.device
    ids = torch.tensor([tokens], device=dev)
    f = target(ids, output_hidden_states=True).hidden_states[-1]  # [1, T, H]
    want = target.get_output_embeddings()(f[0]).argmax(-1)  # want[j] = the target's greedy token after position j
    pred = head(target.get_input_embeddings()(ids[:, 1:]).to(W.dtype), f[:, :-1].to(W.dtype))[0]  # f^_{j+1}, j < T-1
    guess = (pred @ W.T).argmax(-1)  # guess for token j + 2
    if vocab is not None:
        guess = vocab[guess]
    hit = torch.zeros(len(tokens), dtype=torch.bool)
    hit[2:] = (guess[:-1] == want[1:-1]).cpu()  # token t = j + 2 against the target's greedy token after t - 1
    return hit
