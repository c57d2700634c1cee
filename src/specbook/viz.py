"""Plots and widgets for the notebooks.

A widget's callback is a plain function here (``speedup_view`` ...), also called directly once
in each notebook so the headless test run exercises it (design.md).
"""

from __future__ import annotations

import html

from .roofline import expected_speedup, expected_tokens_per_step


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
    best = max(gs[1:], key=lambda g: expected_speedup(alpha, g, c))
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
