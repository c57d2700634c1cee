"""Load an exported draft with speculators itself and run it on fixed inputs (runs in the speculators env).

    python scripts/check_speculators.py EXPORT_DIR INPUTS.safetensors OUT.safetensors

EXPORT_DIR: what `python -m specbook.export eagle3 ... --verifier LOCAL_MODEL_DIR` wrote. INPUTS: `fused`
[1, S, 3H] (the target's hidden states at the draft's taps), `input_ids` [1, S] (the token after each position),
`steps` (a 1-element tensor). OUT: `logits_{i}` [S, draft_vocab] per training-time-test step i, as speculators'
Eagle3DraftModel computes them (captured from its lm_head), plus its config's layer ids as `aux_layer_ids`.
No specbook import here: this environment holds speculators' pins, not ours.
"""
import sys

import torch
from safetensors.torch import load_file, save_file


def main(export_dir: str, inputs: str, out: str) -> None:
    import speculators
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel

    cfg = SpeculatorModelConfig.from_pretrained(export_dir)  # pydantic validation of config.json
    cfg.transformer_layer_config._attn_implementation = "eager"  # CPU: no flex attention
    model = SpeculatorModel.from_pretrained(export_dir, config=cfg, dtype=torch.float32)
    assert isinstance(model, Eagle3DraftModel), type(model)
    model.eval()
    x = load_file(inputs)
    S = x["input_ids"].shape[1]
    captured = []
    model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach().float()[0]))
    with torch.no_grad():
        model(hidden_states=x["fused"].float(), input_ids=x["input_ids"].long(),
              document_ids=torch.zeros(1, S, dtype=torch.long), position_ids=torch.arange(S)[None],
              ttt_steps=int(x["steps"][0]))
    res = {f"logits_{i}": t.contiguous() for i, t in enumerate(captured)}
    res["aux_layer_ids"] = torch.tensor(model.config.eagle_aux_hidden_state_layer_ids)
    res["d2t"], res["t2d"] = model.d2t.cpu().long(), model.t2d.cpu().bool()
    save_file(res, out)
    print(f"speculators {speculators.__version__ if hasattr(speculators, '__version__') else ''} loaded "
          f"{type(model).__name__}: {len(captured)} steps, logits {tuple(captured[0].shape)}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
