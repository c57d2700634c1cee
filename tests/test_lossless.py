"""Losslessness of every method through the whole loop: the joint of the first 3 tokens against the exact one.

One checker (exactness.check_lossless) for every drafter: a tiny random target (vocabulary 4, so the exact
joint of 3 tokens has 64 cells), N loop runs, a noise bound from N exact samples. Each method also runs a
broken variant that must land at >= 3x the bound. With 3 tokens and one token from the prefill, every step
shape is exercised: acceptance at depth 0 and 1, corrections after a rejection, the bonus token after a
fully accepted draft, and a second step after the drafter rolled its state back.
"""
import pytest
import torch

from specbook import verify as V
from specbook.decoding import Drafter, SpecState
from specbook.drafters.dflash import BlockDrafter, BlockNet
from specbook.drafters.draft_model import DraftModelDrafter
from specbook.drafters.eagle import Eagle2Drafter, EagleDrafter, EagleHead
from specbook.drafters.eagle3 import Eagle3Drafter, Eagle3Head
from specbook.drafters.lookup import PromptLookupDrafter
from specbook.drafters.medusa import MedusaDrafter, MedusaHeads
from specbook.drafters.mtp import MTPDrafter, MTPModules
from specbook.exactness import check_lossless, logit_table
from specbook.models import tiny_llama
from specbook.sampling import SamplingConfig, probs_from, sample
from specbook.verify import DraftTree

# Vocabulary 4 and k = 3: 64 cells, small enough that 2,000 runs put a planted bug at >= 3x the noise bound (a run
# of the loop on these 1-layer models costs ~10 ms, so one check ~20 s). The peaked T = 0.7 / top-p 0.9 joint needs
# fewer runs for the same bound. Seeds: a draft and heads whose proposals cover about half of the target's mass,
# where a bug in the residual moves the most probability (a test of how far a planted bug moves the joint).
VOCAB, K = 4, 3
PROMPT = [0, 3, 2, 1]
CONFIGS = {"T1": SamplingConfig(1.0), "T0.7-top_p0.9": SamplingConfig(0.7, top_p=0.9)}
N = {"T1": 2000, "T0.7-top_p0.9": 1000}


class TreeDrafter(Drafter):
    """A depth-2 tree from a draft model (no cache: full forwards, fine for a tiny model): ``width`` children of
    the root, one child under each. ``iid``: children sampled i.i.d. from q (duplicates possible, q carried);
    else the top-``width`` picks and each one's top-1 child (one-hot, q = None)."""

    def __init__(self, draft, width: int = 2, iid: bool = True):
        self.draft, self.width, self.iid = draft, width, iid

    def _q(self, seqs, state):  # [len(seqs), V]: the draft's next-token distribution after each sequence
        with torch.no_grad():
            return probs_from(self.draft(torch.tensor(seqs)).logits[:, -1], state.sampling)

    def propose(self, state: SpecState) -> DraftTree:
        q0 = self._q([state.tokens], state)[0]
        first = [int(sample(q0, state.generator)) for _ in range(self.width)] if self.iid else \
            q0.topk(self.width).indices.tolist()
        qc = self._q([state.tokens + [c] for c in first], state)  # one forward for every child's child
        toks = first + [int(sample(q, state.generator)) if self.iid else int(q.argmax()) for q in qc]
        qs = [q0] * self.width + list(qc)
        parents = [-1] * self.width + list(range(self.width))
        return DraftTree(torch.tensor(toks), torch.tensor(parents), torch.stack(qs) if self.iid else None)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=3)


@pytest.fixture(scope="module")
def table(target):
    return logit_table(target, PROMPT, depth=K - 1)


def _medusa_heads(target):
    heads = MedusaHeads(target.config.hidden_size, n_heads=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return heads.eval()


def _eagle_head(target):
    torch.manual_seed(0)
    return EagleHead(target.config).eval()


def _mtp_modules(target, depth=2):
    torch.manual_seed(0)
    mods = MTPModules(target.config, depth)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights large enough that each module's q differs from the others' and from uniform
        for p in mods.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return mods.eval()


def _eagle3_head(target):
    torch.manual_seed(0)
    head = Eagle3Head(target.config, torch.tensor([0, 2, 3]), taps=(0, 1, 1))  # a reduced vocabulary: d2t in use
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return head.eval()


def _block_net(target, rank=0, seed=4, noise=0.1):
    """A 2-token block drafter, small weights: its q is far enough from the target's p that a planted bug shows."""
    torch.manual_seed(0)
    net = BlockNet(target.config, torch.tensor([0, 2, 3]), gamma=2, layers=1, taps=(1,), markov_rank=rank,
                   confidence=bool(rank))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return net.eval()


def _peeking(propose):
    """The planted bug of a truncation rule: the draft is cut at the first token that is not the draft's own top
    choice — a decision that reads x_k, so the kept tokens are no longer draws from q."""

    def wrapped(self, state):
        d = propose(self, state)
        n = next((i for i in range(len(d)) if int(d.q[i].argmax()) != int(d.tokens[i])), len(d))
        return DraftTree.chain(d.tokens[:n], d.q[:n])

    return wrapped


DRAFTERS = {
    "sps_chain": lambda t: DraftModelDrafter(tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=5), gamma=2),
    "sps_gamma1": lambda t: DraftModelDrafter(tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=4), gamma=1),
    "sps_reduced_vocab": lambda t: DraftModelDrafter(tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=4), gamma=2,
                                                     vocab=torch.tensor([0, 2, 3])),
    "lookup": lambda t: PromptLookupDrafter(3, max_ngram=1),
    "iid_tree": lambda t: TreeDrafter(tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=4), iid=True),
    "onehot_tree": lambda t: TreeDrafter(tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=4), iid=False),
    "medusa": lambda t: MedusaDrafter(t, _medusa_heads(t), [(0,), (1,), (0, 0), (1, 0)]),
    "eagle_static": lambda t: EagleDrafter(t, _eagle_head(t), choices=[(0,), (1,), (0, 0), (1, 0)]),
    "eagle_dynamic": lambda t: Eagle2Drafter(t, _eagle_head(t), depth=2, top_k=2, total_tokens=4),
    "eagle_static_noreplace": lambda t: EagleDrafter(t, _eagle_head(t), choices=[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)],
                                                     children="noreplace"),
    "eagle_static_iid": lambda t: EagleDrafter(t, _eagle_head(t), choices=[(0,), (1,), (0, 0), (1, 0)], children="iid"),
    "eagle_dynamic_noreplace": lambda t: Eagle2Drafter(t, _eagle_head(t), depth=3, top_k=2, total_tokens=6,
                                                       children="noreplace"),
    "eagle_dynamic_iid": lambda t: Eagle2Drafter(t, _eagle_head(t), depth=2, top_k=2, total_tokens=4, children="iid"),
    # "auto": each depth draws what a steep latency curve pays for, 1 to 3 nodes per depth (roofline.nodes_to_add)
    "eagle_dynamic_noreplace_auto": lambda t: Eagle2Drafter(t, _eagle_head(t), depth=3, top_k=3, total_tokens="auto",
                                                            latency=STEEP, draft_cost=0.0, children="noreplace"),
    "mtp": lambda t: MTPDrafter(t, _mtp_modules(t)),
    "eagle3": lambda t: Eagle3Drafter(t, _eagle3_head(t), depth=2, top_k=2, total_tokens=4),
    "dflash": lambda t: BlockDrafter(t, _block_net(t)),
    # a static survival threshold that cuts most blocks to 1 of their 2 tokens
    "dspark": lambda t: BlockDrafter(t, _block_net(t, rank=4, seed=1, noise=0.05), threshold=0.25),
}


STEEP = {1: 1.0, 2: 1.1, 4: 1.6, 8: 3.0}  # a made-up latency curve (seconds) under which tree sizes vary by step


CORE = ["sps_chain", "iid_tree", "onehot_tree", "medusa", "eagle_static", "eagle_dynamic", "mtp", "eagle3", "dspark",
        "eagle_static_noreplace", "eagle_dynamic_noreplace"]
CASES = [(kind, cfg) for kind in CORE for cfg in CONFIGS] + \
    [(kind, "T1") for kind in DRAFTERS if kind not in CORE]  # variants of a core path: T = 1 only


@pytest.mark.parametrize("kind,cfg", CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_loop_is_lossless(target, table, kind, cfg):
    n = N[cfg] if kind in CORE else N[cfg] // 2
    res = check_lossless(target, DRAFTERS[kind](target), PROMPT, CONFIGS[cfg], n=n, k=K, seed=1, table=table)
    print(kind, cfg, res)
    assert res.ok, f"{kind} at {cfg}: {res}"


# method -> (the bug, how to plant it): each is a real bug class of the code the method relies on
BROKEN = {
    "sps_chain": ("correction sampled from p instead of the residual norm(max(0, p - q))",
                  lambda mp: mp.setattr(V, "residual", lambda p, q: p)),
    "iid_tree": ("rejected sibling's q not removed before the next sibling",
                 lambda mp: mp.setattr(V, "residual", lambda p, q: p)),
    "onehot_tree": ("rejected one-hot pick not removed from p", lambda mp: mp.setattr(V, "residual_one_hot", lambda p, x: p)),
    "medusa": ("rejected one-hot pick not removed from p", lambda mp: mp.setattr(V, "residual_one_hot", lambda p, x: p)),
    "eagle_static": ("rejected one-hot pick not removed from p",
                     lambda mp: mp.setattr(V, "residual_one_hot", lambda p, x: p)),
    "eagle_dynamic": ("rejected one-hot pick not removed from p",
                      lambda mp: mp.setattr(V, "residual_one_hot", lambda p, x: p)),
    "eagle_static_noreplace": ("without-replacement siblings verified against q instead of q minus the earlier draws",
                               lambda mp: _forget_removal(mp)),
    "eagle_dynamic_noreplace": ("without-replacement siblings verified against q instead of q minus the earlier draws",
                                lambda mp: _forget_removal(mp)),
    "eagle3": ("rejected one-hot pick not removed from p", lambda mp: mp.setattr(V, "residual_one_hot", lambda p, x: p)),
    "mtp": ("correction sampled from p instead of the residual norm(max(0, p - q))",
            lambda mp: mp.setattr(V, "residual", lambda p, q: p)),
    "dflash": ("correction sampled from p instead of the residual norm(max(0, p - q))",
               lambda mp: mp.setattr(V, "residual", lambda p, q: p)),
    "dspark": ("the block cut after seeing the drafted token (at the first non-argmax draw) instead of before drawing it",
               lambda mp: mp.setattr(BlockDrafter, "propose", _peeking(BlockDrafter.propose))),
}


def _forget_removal(mp):
    """The planted bug: every sibling carries the node's full q (the drawn tokens never removed), and the
    sibling contract check that would catch it is switched off."""
    import specbook.drafters.eagle.drafter as E

    mp.setattr(E, "without_replacement_rows", lambda q, idx: q.float()[None].expand(len(idx), -1))
    mp.setattr(V.DraftTree, "check_siblings", lambda self: None)


@pytest.mark.parametrize("kind", list(BROKEN))
def test_broken_variant_fails_clearly(target, table, kind, monkeypatch):
    bug, plant = BROKEN[kind]
    plant(monkeypatch)
    res = check_lossless(target, DRAFTERS[kind](target), PROMPT, CONFIGS["T1"], n=N["T1"], k=K, seed=1, table=table)
    print(kind, bug, res)
    assert res.ratio >= 3, f"{kind} with a planted bug ({bug}) should fail clearly: {res}"


def test_noise_bound_holds_for_exact_samples(table):
    """The bound itself: a perfect sampler (draws from the exact joint) passes it, every time in 50 tries."""
    from specbook.exactness import exact_joint, noise_floor

    exact = exact_joint(table, CONFIGS["T1"], K)
    floors = noise_floor(exact, N["T1"], torch.Generator().manual_seed(7), trials=50)
    ref = noise_floor(exact, N["T1"], torch.Generator().manual_seed(8))
    assert float(floors.max()) < float(ref.mean() + 4 * ref.std())
    assert abs(float(exact.sum()) - 1) < 1e-6 and exact.shape == (VOCAB ** K,)


def test_exact_joint_marginal_matches_first_two(table):
    from specbook.exactness import exact_first_two, exact_joint

    cfg = CONFIGS["T1"]
    j3 = exact_joint(table, cfg, 3).reshape(VOCAB, VOCAB, VOCAB)
    torch.testing.assert_close(j3.sum(-1), exact_first_two(table, cfg))
