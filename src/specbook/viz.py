"""Plots and widgets for the notebooks.

A widget's callback is a plain function here (``speedup_view`` ...), also called directly once
in each notebook so the headless test run exercises it.
"""

from __future__ import annotations

import html

from .roofline import expected_speedup, expected_tokens_per_step, optimal_gamma


def speedup_view(alpha: float = 0.7, gamma: int = 4, c: float = 0.1, ax=None, max_gamma: int = 12) -> str:
    """Plot Leviathan's expected walltime improvement vs gamma for the given alpha and c.

    Draws on ``ax`` (a new figure if None) and returns a one-line summary; the widget prints it,
    so the text changes whenever a slider moves.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    gs = list(range(0, max_gamma + 1))
    for a in sorted({0.5, 0.7, 0.9, round(alpha, 2)}):
        ys = [expected_speedup(a, g, c) for g in gs]
        style = dict(lw=2.5, color="C3") if a == round(alpha, 2) else dict(lw=1, alpha=0.5)
        ax.plot(gs, ys, marker="o", ms=3, label=f"alpha={a:.2f}", **style)
    here = expected_speedup(alpha, gamma, c)
    ax.scatter([gamma], [here], s=80, color="C3", zorder=5)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("gamma (draft tokens per step)")
    ax.set_ylabel("expected speedup")
    ax.set_title(f"c = T_draft / T_target = {c:.2f}")
    ax.legend(fontsize=8)
    best = optimal_gamma(alpha, c, max_gamma=max_gamma)
    return (f"alpha={alpha:.2f} gamma={gamma} c={c:.2f}: E[tokens/step]={expected_tokens_per_step(alpha, gamma):.2f}, "
            f"expected speedup={here:.2f}x (best gamma for this alpha, c: {best}, {expected_speedup(alpha, best, c):.2f}x)")


def speedup_widget(alpha: float = 0.7, gamma: int = 4, c: float = 0.1):
    """Sliders for alpha, gamma, c driving ``speedup_view``."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    a = w.FloatSlider(value=alpha, min=0.0, max=0.99, step=0.01, description="alpha")
    g = w.IntSlider(value=gamma, min=1, max=12, description="gamma")
    cc = w.FloatSlider(value=c, min=0.0, max=1.0, step=0.01, description="c")
    out = w.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(6, 3.2))
            text = speedup_view(a.value, g.value, cc.value, ax=ax)
            print(text)
            plt.show()

    for s in (a, g, cc):
        s.observe(redraw, names="value")
    redraw()
    box = w.VBox([w.HBox([a, g, cc]), out])
    display(box)
    return box


def color_tokens(pieces: list[tuple[str, str]]) -> str:
    """HTML for a token stream; ``pieces`` = [(text, kind)], kind in accepted/rejected/corrected/bonus/prompt."""
    colors = {"accepted": "#b7e4c7", "rejected": "#f4a3a3", "corrected": "#a9c9f5", "bonus": "#ffe08a",
              "prompt": "#eeeeee", "plain": "transparent"}
    spans = []
    for text, kind in pieces:
        style = f"background:{colors.get(kind, 'transparent')};" + ("text-decoration:line-through;" if kind == "rejected" else "")
        spans.append(f'<span style="{style}" title="{kind}">{html.escape(text)}</span>')
    return '<div style="font-family:monospace;white-space:pre-wrap;line-height:1.6">' + "".join(spans) + "</div>"


def trace_pieces(tokenizer, trace: list[dict], first_token: int | None = None) -> list[tuple[str, str]]:
    """A speculative trace (decoding.speculative_generate(trace=[])) -> coloured pieces.

    accepted draft tokens: green; the first rejected draft token: red, struck through;
    the target's correction: blue; the bonus token after a fully accepted draft: yellow.
    """
    dec = lambda t: tokenizer.decode([t])  # noqa: E731
    pieces = [(dec(first_token), "plain")] if first_token is not None else []
    for step in trace:
        path = step["path"]
        for i in path:
            pieces.append((dec(step["draft"][i]), "accepted"))
        kids = [i for i, p in enumerate(step["parents"]) if p == (path[-1] if path else -1)]
        if not step["bonus"] and kids:
            pieces.append((dec(step["draft"][kids[0]]), "rejected"))
        pieces.append((dec(step["next"]), "bonus" if step["bonus"] else "corrected"))
    return pieces


def legend_html() -> str:
    return color_tokens([("accepted draft", "accepted"), (" ", "plain"), ("rejected draft", "rejected"), (" ", "plain"),
                         ("target correction", "corrected"), (" ", "plain"), ("bonus", "bonus")])


def sps_view(target, draft, tokenizer, prompt: str, gamma: int = 4, temperature: float = 0.0, max_new_tokens: int = 32,
             seed: int = 0) -> tuple[str, dict]:
    """Run SpS once on ``prompt`` and return (coloured HTML, stats) — the notebook 01 widget callback."""
    from .decoding import encode, speculative_generate
    from .drafters.draft_model import DraftModelDrafter
    from .sampling import SamplingConfig, make_generator

    ids, _ = encode(tokenizer, prompt, device=target.device)
    trace: list = []
    cfg = SamplingConfig(temperature=temperature)
    res = speculative_generate(target, DraftModelDrafter(draft, gamma), ids, max_new_tokens=max_new_tokens,
                               sampling=cfg, generator=None if cfg.greedy else make_generator(seed),
                               eos_token_id=tokenizer.eos_token_id, trace=trace)
    s = res.stats
    info = {"gamma": gamma, "temperature": temperature, "tau": round(s.tau, 2), "target_forwards": s.target_forwards,
            "new_tokens": s.new_tokens}
    head = (f"<b>gamma={gamma}, T={temperature}</b>: {s.new_tokens} tokens in {s.target_forwards} target forwards "
            f"(tau = {s.tau:.2f})<br>")
    return head + legend_html() + color_tokens(trace_pieces(tokenizer, trace, res.tokens[0][0])), info


def slider_widget(sliders: dict, render):
    """One widget shape for every notebook: ``sliders`` {name: ipywidgets slider}; on any change,
    ``render(**values)`` runs and its output (HTML string, or (figure, info)) replaces the previous one."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import HTML, display

    out = w.Output()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            r = render(**{k: s.value for k, s in sliders.items()})
            if isinstance(r, str):
                display(HTML(r))
            else:
                fig, info = r
                print(info)
                display(fig)
                plt.close(fig)

    for sl in sliders.values():
        sl.continuous_update = False  # one redraw when the slider is released, not one per value dragged through
        sl.observe(redraw, names="value")
    redraw()
    box = w.VBox([w.HBox(list(sliders.values())), out])
    display(box)
    return box


def sps_widget(target, draft, tokenizer, prompt: str, gamma: int = 4, temperature: float = 0.0, max_new_tokens: int = 32):
    """Sliders for gamma and temperature driving ``sps_view``."""
    import ipywidgets as w

    return slider_widget(
        {"gamma": w.IntSlider(value=gamma, min=1, max=10, description="gamma"),
         "temperature": w.FloatSlider(value=temperature, min=0.0, max=1.5, step=0.1, description="temperature")},
        lambda gamma, temperature: sps_view(target, draft, tokenizer, prompt, gamma, temperature, max_new_tokens)[0])


# --------------------------------------------------------------------------- token trees (notebook 02)


def plot_tree(ax, parents, labels: list[str] | None = None, root_label: str = "root", highlight: list[int] = ()):
    """Draw a draft tree (parents array, -1 = root) left to right by depth; ``highlight`` = an accepted path."""
    import torch

    from .tree import depths

    parents = torch.as_tensor(parents)
    d = depths(parents).tolist() if len(parents) else []
    p = parents.tolist()
    # y: leaves get consecutive rows, inner nodes the mean of their children
    kids: dict[int, list[int]] = {}
    for i, par in enumerate(p):
        kids.setdefault(par, []).append(i)
    y: dict[int, float] = {}
    nxt = [0.0]

    def place(n):
        if n not in kids:
            y[n] = nxt[0]
            nxt[0] += 1
        else:
            for c in kids[n]:
                place(c)
            y[n] = sum(y[c] for c in kids[n]) / len(kids[n])

    place(-1)
    xy = {-1: (0, y[-1]), **{i: (d[i] + 1, y[i]) for i in range(len(p))}}
    hl = set(highlight)
    for i, par in enumerate(p):
        (x0, y0), (x1, y1) = xy[par], xy[i]
        on = i in hl and (par < 0 or par in hl)
        ax.plot([x0, x1], [y0, y1], color="C2" if on else "0.6", lw=2.5 if on else 1, zorder=1)
    for n, (x, yy) in xy.items():
        text = root_label if n < 0 else (labels[n] if labels else str(n))
        ax.text(x, yy, text, ha="center", va="center", fontsize=8, zorder=2,
                bbox=dict(boxstyle="round,pad=0.25", fc="#c8f7c5" if n in hl else ("#eee" if n >= 0 else "#ffd27f"),
                          ec="0.4"))
    ax.set_xlim(-0.6, max(d, default=0) + 1.6)
    ax.set_ylim(max(y.values()) + 0.8, -0.8)
    # one depth convention across the notebooks: the root (the last committed token) is depth 0
    ax.set_xticks(range(max(d, default=0) + 2), ["root"] + [f"depth {i + 1}" for i in range(max(d, default=0) + 1)])
    ax.set_yticks([])
    for s in ("top", "right", "left"):
        ax.spines[s].set_visible(False)


def plot_tree_mask(ax, parents):
    """The tree-attention mask over [root] + nodes (white = may attend)."""
    import torch

    from .tree import ancestor_mask

    m = ancestor_mask(torch.as_tensor(parents))
    ax.imshow(m, cmap="gray", vmin=0, vmax=1, interpolation="nearest")  # allowed = 1 = white
    n = m.shape[0]
    ax.set_xticks(range(n), ["r"] + [str(i) for i in range(n - 1)], fontsize=7)
    ax.set_yticks(range(n), ["r"] + [str(i) for i in range(n - 1)], fontsize=7)
    ax.set_xlabel("key (node)")
    ax.set_ylabel("query (node)")


def medusa_view(target, heads, vocab, acc, tokenizer, prompt: str, n_nodes: int = 8, top_k: int = 4,
                max_new_tokens: int = 32) -> tuple[object, dict]:
    """Build the sparse tree of ``n_nodes`` from the heads' rank accuracies ``acc`` restricted to the top ``top_k``
    ranks, decode ``prompt`` greedily with it, and draw the first step's tree — the notebook 02 widget callback.
    Returns (figure, stats)."""
    import matplotlib.pyplot as plt

    from .decoding import encode, speculative_generate
    from .drafters.medusa import MedusaDrafter
    from .tree import sparse_tree

    choices = sparse_tree([row[:top_k] for row in acc], n_nodes)
    drafter = MedusaDrafter(target, heads, choices, vocab=vocab)
    ids, _ = encode(tokenizer, prompt, device=target.device)
    trace: list = []
    res = speculative_generate(target, drafter, ids, max_new_tokens=max_new_tokens, trace=trace,
                               eos_token_id=tokenizer.eos_token_id)
    s = res.stats
    step = max(trace, key=lambda t: len(t["path"])) if trace else None
    fig, ax = plt.subplots(figsize=(7, max(2.0, 0.28 * len(choices))))
    if step:
        plot_tree(ax, step["parents"], [repr(tokenizer.decode([t]))[1:-1][:10] for t in step["draft"]],
                  highlight=step["path"])
        ax.set_title(f"the step that accepted the most ({len(step['path'])} of {len(choices)} nodes), "
                     "accepted path in green", fontsize=9)
    info = {"n_nodes": len(choices), "top_k": top_k, "depth": max(len(c) for c in choices), "tau": round(s.tau, 2),
            "target_forwards": s.target_forwards, "new_tokens": s.new_tokens}
    return fig, info


def medusa_widget(target, heads, vocab, acc, tokenizer, prompt: str, n_nodes: int = 8, top_k: int = 4,
                  max_new_tokens: int = 32):
    """Sliders for tree size and top-k driving ``medusa_view``."""
    import ipywidgets as w

    return slider_widget(
        {"n_nodes": w.IntSlider(value=n_nodes, min=1, max=32, description="tree nodes"),
         "top_k": w.IntSlider(value=top_k, min=1, max=len(acc[0]), description="top-k")},
        lambda n_nodes, top_k: medusa_view(target, heads, vocab, acc, tokenizer, prompt, n_nodes, top_k, max_new_tokens))


# --------------------------------------------------------------------------- EAGLE (notebook 03)


def eagle_view(target, head, vocab, tokenizer, prompt: str, depth: int = 5, top_k: int = 4, total_tokens: int = 16,
               max_new_tokens: int = 32) -> tuple[object, dict]:
    """EAGLE-2's dynamic tree for ``prompt``: decode greedily with (depth, top_k, total_tokens) and draw the step
    that accepted the most, node labels = token and draft confidence — the notebook 03 widget callback (and
    notebook 05's, given an EAGLE-3 head)."""
    import matplotlib.pyplot as plt

    from .decoding import encode, speculative_generate
    from .drafters.eagle import Eagle2Drafter
    from .drafters.eagle3 import Eagle3Drafter, Eagle3Head

    total_tokens = max(total_tokens, depth)
    eagle3 = isinstance(head, Eagle3Head)  # an EAGLE-3 head carries its own draft vocabulary (vocab is ignored)
    drafter = (Eagle3Drafter(target, head, depth=depth, top_k=top_k, total_tokens=total_tokens) if eagle3 else
               Eagle2Drafter(target, head, vocab, depth=depth, top_k=top_k, total_tokens=total_tokens))
    ids, _ = encode(tokenizer, prompt, device=target.device)
    trace: list = []
    conf: list = []
    orig = drafter.propose

    def propose(state):  # keep each step's confidences for the labels
        t = orig(state)
        conf.append(t.confidence.tolist())
        return t

    drafter.propose = propose
    res = speculative_generate(target, drafter, ids, max_new_tokens=max_new_tokens, trace=trace,
                               eos_token_id=tokenizer.eos_token_id)
    s = res.stats
    i = max(range(len(trace)), key=lambda j: len(trace[j]["path"])) if trace else None
    fig, ax = plt.subplots(figsize=(8, max(2.0, 0.3 * total_tokens)))
    if i is not None:
        step = trace[i]
        labels = [f"{repr(tokenizer.decode([t]))[1:-1][:8]} {c:.2f}" for t, c in zip(step["draft"], conf[i])]
        plot_tree(ax, step["parents"], labels, highlight=step["path"])
        name = "EAGLE-3" if eagle3 else "EAGLE-2"
        ax.set_title(f"{name} tree (depth {depth}, top_k {top_k}, {len(step['draft'])} nodes): the step that accepted "
                     f"the most ({len(step['path'])}), accepted path in green; labels = token, draft confidence",
                     fontsize=9)
    info = {"depth": depth, "top_k": top_k, "total_tokens": total_tokens, "tau": round(s.tau, 2),
            "target_forwards": s.target_forwards, "new_tokens": s.new_tokens}
    return fig, info


def eagle_widget(target, head, vocab, tokenizer, prompt: str, depth: int = 5, top_k: int = 4, total_tokens: int = 16,
                 max_new_tokens: int = 32):
    """Sliders for depth, top_k and total_tokens driving ``eagle_view``."""
    import ipywidgets as w

    return slider_widget(
        {"depth": w.IntSlider(value=depth, min=1, max=8, description="depth"),
         "top_k": w.IntSlider(value=top_k, min=1, max=8, description="top_k"),
         "total_tokens": w.IntSlider(value=total_tokens, min=1, max=64, description="total_tokens")},
        lambda depth, top_k, total_tokens: eagle_view(target, head, vocab, tokenizer, prompt, depth, top_k,
                                                      total_tokens, max_new_tokens))


# --------------------------------------------------------------------------- MTP (notebook 04)


def mtp_view(target, modules, vocab, tokenizer, prompt: str, depth: int = 3, temperature: float = 0.0,
             max_new_tokens: int = 32, seed: int = 0) -> tuple[str, dict]:
    """Decode ``prompt`` with the first ``depth`` MTP modules and colour every step's drafted tokens (accepted,
    first rejected, the target's correction or bonus) — the notebook 04 widget callback."""
    from .decoding import encode, speculative_generate
    from .drafters.mtp import MTPDrafter
    from .sampling import SamplingConfig, make_generator

    ids, _ = encode(tokenizer, prompt, device=target.device)
    trace: list = []
    cfg = SamplingConfig(temperature=temperature)
    res = speculative_generate(target, MTPDrafter(target, modules, vocab, depth=depth), ids, sampling=cfg,
                               generator=None if cfg.greedy else make_generator(seed), max_new_tokens=max_new_tokens,
                               eos_token_id=tokenizer.eos_token_id, trace=trace)
    s = res.stats
    per_step = [len(t["path"]) for t in trace]
    info = {"depth": depth, "temperature": temperature, "tau": round(s.tau, 2), "target_forwards": s.target_forwards,
            "new_tokens": s.new_tokens, "accepted_per_step": per_step}
    head = (f"<b>D={depth}, T={temperature}</b>: {s.new_tokens} tokens in {s.target_forwards} target forwards "
            f"(tau = {s.tau:.2f}); drafted tokens accepted per step: {per_step}<br>")
    return head + legend_html() + color_tokens(trace_pieces(tokenizer, trace, res.tokens[0][0])), info


def mtp_widget(target, modules, vocab, tokenizer, prompt: str, depth: int = 3, temperature: float = 0.0,
               max_new_tokens: int = 32):
    """Sliders for the depth D (modules used) and the temperature driving ``mtp_view``."""
    import ipywidgets as w

    return slider_widget(
        {"depth": w.IntSlider(value=depth, min=1, max=modules.depth, description="depth D"),
         "temperature": w.FloatSlider(value=temperature, min=0.0, max=1.5, step=0.1, description="temperature")},
        lambda depth, temperature: mtp_view(target, modules, vocab, tokenizer, prompt, depth, temperature,
                                            max_new_tokens)[0])


# --------------------------------------------------------------------------- DFlash / DSpark (notebook 06)


def plot_block_mask(ax, anchors, S: int, gamma: int):
    """Training's block attention (drafters.dflash.block_mask) for blocks at ``anchors`` in a window of S positions:
    rows = block queries, columns = the window's context keys then the blocks' own keys; white = may attend."""
    import torch

    from .drafters.dflash import block_mask

    m = block_mask(torch.as_tensor(anchors), S, gamma)
    ax.imshow(m.numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest", aspect="auto")
    ax.axvline(S - 0.5, color="C1", lw=1.5)
    n = gamma + 1
    for b in range(1, len(anchors)):
        ax.axhline(b * n - 0.5, color="C0", lw=0.8)
    ax.set_yticks([b * n for b in range(len(anchors))], [f"anchor {int(a)}" for a in anchors], fontsize=7)
    ax.set_xticks([0, S - 1, S, S + len(anchors) * n - 1], ["0", str(S - 1), "block keys", ""], fontsize=7)
    ax.set_xlabel("keys: context positions (features injected as K/V) | block positions")
    ax.set_title("block attention in training (white = may attend)", fontsize=9)


def cut_steps(steps: list[dict], threshold: float) -> dict:
    """What a static survival threshold would have done to full-block steps: each step {"tokens", "survival"
    (a_1..a_g), "accepted" (how many the target accepted)} -> kept / wasted (verified, rejected) / lost (cut, but
    the target would have accepted them) token counts, and per step the cut position."""
    from .drafters.dflash import static_cut

    cuts, kept, wasted, lost = [], 0, 0, 0
    for s in steps:
        n_acc = s["accepted"]
        cut = static_cut(s["survival"], threshold)
        cuts.append(cut)
        kept += min(cut, n_acc)
        wasted += max(0, cut - n_acc)
        lost += max(0, n_acc - cut)
    return {"cuts": cuts, "kept": kept, "wasted": wasted, "lost": lost, "verified": sum(cuts)}


def dspark_cut_view(steps: list[dict], tokenizer, threshold: float = 0.3, max_steps: int = 12):
    """The notebook 06 widget callback: the first ``max_steps`` full-block DSpark steps as rows of gamma cells
    (green = accepted by the target, red = verified and rejected, white = never reached after a rejection);
    cells at or after the threshold's cut are hatched (not verified), each cell labelled with its token and
    calibrated survival a_k. -> (figure, counts over every step)."""
    import matplotlib.pyplot as plt

    info = cut_steps(steps, threshold)
    shown = steps[:max_steps]
    g = max((len(s["tokens"]) for s in shown), default=1)
    fig, ax = plt.subplots(figsize=(min(2 + 1.25 * g, 13), 0.42 * len(shown) + 1.1))
    for r, (s, cut) in enumerate(zip(shown, info["cuts"])):
        for k, t in enumerate(s["tokens"]):
            color = "#9be39b" if k < s["accepted"] else "#f4a3a3" if k == s["accepted"] else "white"
            ax.add_patch(plt.Rectangle((k, -r), 0.95, 0.9, fc=color, ec="k", lw=0.4,
                                       hatch="///" if k >= cut else None))
            word = tokenizer.decode([t]).replace("\n", "\\n")[:8] if tokenizer is not None else str(t)
            ax.text(k + 0.47, -r + 0.45, f"{word}\n{s['survival'][k]:.2f}", ha="center", va="center", fontsize=6)
    ax.set_xlim(-0.1, g + 0.1)
    ax.set_ylim(-len(shown) + 0.8, 1.0)
    ax.set_xticks([k + 0.47 for k in range(g)], [str(k + 1) for k in range(g)])
    ax.set_yticks([])
    ax.set_xlabel("block position k (label: token, calibrated survival a_k)")
    ax.set_title(f"threshold {threshold:.2f}: hatched = cut (not verified). All steps: {info['kept']} accepted "
                 f"tokens kept, {info['wasted']} verified slots wasted, {info['lost']} accepted tokens cut",
                 fontsize=9)
    plt.tight_layout()
    return fig, {k: v for k, v in info.items() if k != "cuts"}


def dspark_widget(steps: list[dict], tokenizer, threshold: float = 0.3):
    """A threshold slider over ``dspark_cut_view`` (the decode is recorded once; the slider re-cuts it)."""
    import ipywidgets as w

    return slider_widget({"threshold": w.FloatSlider(value=threshold, min=0.0, max=1.0, step=0.05,
                                                     description="threshold")},
                         lambda threshold: dspark_cut_view(steps, tokenizer, threshold))


def plot_admission(ax, path: list[dict], base_theta: float) -> None:
    """Algorithm 1's walk on one batch: Theta after each admitted candidate (in greedy order), the early stop's
    choice and the full search's maximum."""
    xs = list(range(len(path) + 1))
    th = [base_theta] + [r["theta"] for r in path]
    ax.plot(xs, th, "o-", color="0.4", ms=4, lw=1)
    n_ok = sum(r["admitted"] for r in path)
    ax.plot(xs[:n_ok + 1], th[:n_ok + 1], "o-", color="C2", ms=5, label=f"early stop: {n_ok} admitted")
    best = max(range(len(th)), key=th.__getitem__)
    ax.plot([best], [th[best]], "*", ms=14, color="C3", label=f"full search's maximum: {best} admitted")
    ax.set_xticks(xs)
    ax.set_xticklabels(["none"] + [f"r{r['request']}·{r['position']}" for r in path], rotation=90, fontsize=7)
    ax.set_xlabel("candidates (request · position) in descending survival")
    ax.set_ylabel("Theta = tau* x SPS(B)  (tokens / s)")
    ax.legend(fontsize=8)


def serving_view(sweep: dict, concurrency: int = 16, policy: str = "alg1"):
    """Throughput vs concurrency for every policy of a serving sweep (``serving.run_sweep`` JSON): real runs as
    points, the trace-driven SIMULATION as lines up to 256; ``concurrency`` / ``policy`` highlighted. Returns (fig,
    info)."""
    import matplotlib.pyplot as plt

    from .serving import sim_costs, simulate

    costs = sim_costs(sweep)
    mx = sweep["settings"]["max_new_tokens"]
    levels = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, int(concurrency)})
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    sim = {}
    for i, pol in enumerate(sweep["settings"]["policies"]):
        sim[pol] = [simulate(sweep["traces"], pol, c, costs, max_new_tokens=mx)["throughput"] for c in levels]
        real = [(r["concurrency"], r["throughput"]) for r in sweep["rows"] if r["policy"] == pol]
        lw = 2.5 if pol == policy else 1
        ax.plot(levels, sim[pol], "-", color=f"C{i}", lw=lw, alpha=0.8, label=f"{pol}")
        ax.plot([c for c, _ in real], [t for _, t in real], "o", color=f"C{i}", ms=5)
    ax.set_xscale("log", base=2)
    ax.axvline(concurrency, color="0.6", ls=":")
    ax.set_xlabel("concurrency (requests running at once)")
    ax.set_ylabel("throughput (tokens / s)")
    ax.set_title("points: real runs on this machine · lines: simulation from their traces", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    j = levels.index(int(concurrency))
    none = sim["none"][j] if "none" in sim else float("nan")
    info = (f"SIMULATED at concurrency {concurrency}: {policy} {sim[policy][j]:.1f} tok/s, no speculation "
            f"{none:.1f} tok/s ({sim[policy][j] / none:.2f}x)")
    return fig, info


def serving_widget(sweep: dict, concurrency: int = 16, policy: str = "alg1"):
    """Concurrency and policy selectors over ``serving_view`` (the simulation is re-run on every change)."""
    import ipywidgets as w

    return slider_widget({"concurrency": w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                                                           value=concurrency, description="concurrency"),
                          "policy": w.Dropdown(options=sweep["settings"]["policies"], value=policy,
                                               description="policy")},
                         lambda concurrency, policy: serving_view(sweep, concurrency, policy))
