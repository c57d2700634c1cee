"""EAGLE (Li et al. 2024, arXiv 2401.15077) and EAGLE-2's dynamic draft trees (arXiv 2406.16858).

EAGLE drafts at the *feature* level. The target's final hidden state f_j (what its LM head reads)
is far more predictable than the next token; a light head learns f_{j+1} from (f_j, x_{j+1}), where
the token x_{j+1} removes the sampling uncertainty the feature alone cannot know:

    in_j   = fc([e(x_{j+1}) ; f_j])               e = the target's (frozen) token embedding, fc: 2H -> H
    f^_j+1 = Decoder(in_<=j)                       ONE decoder layer of the target's architecture, own KV cache
    q      = softmax(f^_j+1 @ W_lm^T)              the target's own (frozen) LM head

Drafting runs the head autoregressively on its *own* predicted features, growing a token tree:
EAGLE-1 expands a fixed tree spec (static); EAGLE-2 expands, at each depth, the ``top_k`` nodes of
highest cumulative draft log-probability into their ``top_k`` best children, then keeps the global top
``total_tokens`` nodes (the draft's confidence approximates the acceptance rate, so this is the
tree with the highest expected accepted length). The target verifies the tree in one forward with
tree attention and the shared verification core (children are deterministic top-k picks: one-hot q,
so verification is lossless at any temperature).

Draft KV cache: committed positions only, computed from the target's TRUE features. Tree nodes are
appended while drafting and cropped away afterwards; the accepted tokens are re-run with the
target's features at the next step (as the EAGLE reference does), so after every step the draft
cache equals one recomputed from the committed tokens (tests check this).

Deviations from the papers, and why:
- The decoder layer is transformers' own layer of the target's family, with its input norm and a
  final RMSNorm (EAGLE-1 drops the first input norm and has no final norm; EAGLE-3 adds the final
  norm). Our regression target is the target's post-norm feature, which the final norm matches.
- q and the soft cross-entropy use only the ``vocab`` most frequent corpus tokens of the LM head
  (default 8,192, as for Medusa): a 49k-row LM head per draft forward costs as much as several
  decoder layers on a CPU. Proposals stay top-k picks, so verification stays exact.
- Feature noise: uniform U(-noise, noise) on the input features (EAGLE: U(-0.1, 0.1)); our features
  have an RMS of ~1.9, comparable to the paper's scale.
- Auto tree size (``total_tokens="auto"``): not in the papers. Per step, the tree keeps the k nodes
  maximising (1 + sum of the k best path confidences) / (drafting time + latency(k + 1)), with
  latency(k) the target's measured forward latency curve (roofline.profile_latency_vs_k, notebook
  00's cost model) and the drafting time = draft forwards this step x the measured ``draft_cost``.
  With ``draft_cost`` the expansion also stops before ``depth`` once one more draft forward cannot
  raise that rate even if all the frontier's probability were accepted (``worth_expanding``): on hard
  text (low confidence) the head stops after a depth or two instead of spending ``depth`` forwards.
  The paper takes the draft's confidence as the acceptance rate; a head can be over- or underconfident
  (its card records both its held-out top-1 hit rate and its mean top-1 confidence), so the cost model
  reads confidences times ``calibration`` = held-out acceptance / confidence (``confidence_calibration``).

Files: ``head.py`` (the head, its Llama fast path, ``load_eagle``), ``objective.py`` (training),
``dynamic.py`` (EAGLE-2's tree and cost model), ``static.py`` (EAGLE-1's sparse tree), ``drafter.py``
(``EagleRunner``: the head's cache and tree expansion; ``EagleDrafter`` static, ``Eagle2Drafter`` dynamic).
"""

from .drafter import Eagle2Drafter, EagleDrafter, measure_draft_cost
from .dynamic import Pool, confidence_calibration, grow_dynamic, path_outcomes, select_nodes, worth_expanding
from .head import EagleHead, load_eagle
from .objective import EagleObjective, teacher_forced_top1
from .static import static_accuracy, static_tree

__all__ = ["Eagle2Drafter", "EagleDrafter", "EagleHead", "EagleObjective", "Pool", "confidence_calibration", "path_outcomes",
           "grow_dynamic", "load_eagle", "measure_draft_cost", "select_nodes", "static_accuracy",
           "static_tree", "teacher_forced_top1", "worth_expanding"]
