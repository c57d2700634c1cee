"""Export to vLLM's speculators format (export.py): the round trip through our own reader of the format, d2t as
offsets, the layer ids, bad input — and (slow) speculators itself loading the exported EAGLE-3 head and computing
the same draft logits as ours."""
import json
import subprocess
from pathlib import Path

import pytest
import torch

from specbook.drafters.eagle3 import Eagle3Drafter, Eagle3Head
from specbook.export import EXPORTABLE, ExportError, export, load_exported_eagle3, main, write_eagle3
from specbook.models import tiny_llama

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def deep():
    return tiny_llama(vocab_size=48, hidden_size=32, layers=8, seed=1)


def _head(target, vocab=None, seed=0):
    """A tiny EAGLE-3 head with random weights that bf16 holds exactly (the export writes bf16)."""
    vocab = torch.tensor([1, 3, 4, 7, 10, 20, 33, 47]) if vocab is None else vocab
    head = Eagle3Head(target.config, vocab)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
            p.copy_(p.to(torch.bfloat16).float())
    return head.eval()


CARD = {"config": {"norm_before_residual": False}}


def _unrolled_logits(head, target, ids, fused, steps=3):
    with torch.no_grad():
        emb = target.get_input_embeddings()(ids)
        return [head.logits(h) for h in head.unroll(emb, fused, steps)]


def _inputs(target, taps, S=9, seed=0):
    ids = torch.randint(0, target.config.vocab_size, (1, S + 3), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    return ids[:, 1:], torch.cat([hs[t][:, :S] for t in taps], -1)


def test_round_trip_gives_identical_draft_outputs(deep, tmp_path):
    """export -> our reader of the format -> the same head: identical unrolled logits (training-time-test steps
    included) and an identical greedy run of the drafter in the loop."""
    head = _head(deep)
    write_eagle3(tmp_path / "e3", deep, head, CARD, "local/tiny", eos_ids=[1])
    back, cfg = load_exported_eagle3(deep, tmp_path / "e3")
    ids, fused = _inputs(deep, head.taps)
    for a, b in zip(_unrolled_logits(head, deep, ids, fused), _unrolled_logits(back, deep, ids, fused)):
        assert torch.equal(a, b)
    from specbook.decoding import speculative_generate

    prompt = torch.tensor([[3, 7, 10, 4]])
    runs = [speculative_generate(deep, Eagle3Drafter(deep, h, depth=3, top_k=2, total_tokens=6), prompt,
                                 max_new_tokens=12) for h in (head, back)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats.target_forwards == runs[1].stats.target_forwards
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "local/tiny", "architectures": ["LlamaForCausalLM"]}


def test_d2t_holds_offsets_and_the_layer_ids_are_the_trained_taps(deep, tmp_path):
    from safetensors.torch import load_file

    head = _head(deep)
    write_eagle3(tmp_path / "e3", deep, head, CARD, "v", eos_ids=[1])
    st = load_file(str(tmp_path / "e3" / "model.safetensors"))
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    vocab = head.vocab
    assert st["d2t"].dtype == torch.int64 and st["t2d"].dtype == torch.bool
    # vLLM places draft logit i at target id i + d2t[i]: offsets, which differ from the ids themselves here
    assert torch.equal(torch.arange(len(vocab)) + st["d2t"], vocab) and not torch.equal(st["d2t"], vocab)
    assert torch.equal(st["t2d"].nonzero().flatten(), vocab) and len(st["t2d"]) == deep.config.vocab_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(head.taps) == [2, 4, 5]
    assert cfg["norm_before_residual"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["transformer_layer_config"]["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == len(vocab) == st["lm_head.weight"].shape[0]
    assert st["fc.weight"].shape == (32, 3 * 32) and st["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 32
    assert torch.equal(st["embed_tokens.weight"], deep.get_input_embeddings().weight.detach().to(torch.bfloat16))


def test_refuses_methods_without_a_speculators_type(tmp_path):
    for method in ("mtp", "eagle", "medusa", "draft_model", "nonsense"):
        with pytest.raises(ExportError, match=f"cannot export '{method}'.*Exportable: {', '.join(EXPORTABLE)}"):
            export(method, tmp_path / method)
    with pytest.raises(ExportError, match="native mtp"):
        export("mtp", tmp_path / "x")
    with pytest.raises(SystemExit, match="Exportable: eagle3"):
        main(["mtp", str(tmp_path / "cli")])
    assert not any(tmp_path.iterdir())


def test_refuses_a_non_empty_directory_unless_forced(deep, tmp_path):
    head = _head(deep)
    (tmp_path / "e3").mkdir()
    (tmp_path / "e3" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty; pass --force"):
        write_eagle3(tmp_path / "e3", deep, head, CARD, "v", eos_ids=[1])
    assert not (tmp_path / "e3" / "config.json").exists()
    write_eagle3(tmp_path / "e3", deep, head, CARD, "v", eos_ids=[1], force=True)
    assert (tmp_path / "e3" / "config.json").exists()


def test_bad_input(deep, tmp_path):
    head = _head(deep)
    with pytest.raises(ExportError, match=r"misses the EOS token\(s\) \[2\]"):
        write_eagle3(tmp_path / "a", deep, head, CARD, "v", eos_ids=[2])
    with pytest.raises(ExportError, match="speculative_tokens must be an int >= 1"):
        write_eagle3(tmp_path / "b", deep, head, CARD, "v", eos_ids=[1], speculative_tokens=0)
    with pytest.raises(ExportError, match="norm_before_residual = true"):
        write_eagle3(tmp_path / "c", deep, head, {"config": {"norm_before_residual": True}}, "v", eos_ids=[1])
    out = write_eagle3(tmp_path / "d", deep, head, CARD, "v", eos_ids=[1])
    other = tiny_llama(vocab_size=48, hidden_size=32, layers=8, seed=2)
    with pytest.raises(ExportError, match="not this target's embedding"):
        load_exported_eagle3(other, out)
    cfg = json.loads((out / "config.json").read_text())
    for change, msg in ((lambda c: c.pop("norm_before_residual"), "norm_before_residual is true \\(or missing\\)"),
                        (lambda c: c.pop("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids is missing"),
                        (lambda c: c["transformer_layer_config"].update(head_dim=16), "layer config differs")):
        bad = json.loads(json.dumps(cfg))
        change(bad)
        (out / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ExportError, match=msg):
            load_exported_eagle3(deep, out)


@pytest.mark.slow
def test_speculators_loads_the_export_and_computes_our_draft_logits(real, tmp_path):
    """The real consumer: speculators (its own pinned environment, scripts/speculators_env.sh) loads the committed
    EAGLE-3 head exported with the local SmolLM2 directory as its verifier — config validation, weights, the
    verifier's embedding — and its Eagle3DraftModel, run on the target's real features for 3 training-time-test
    steps, gives our logits to 1e-4 (fp32 on both sides; seen: 0 at step 0, ~6e-6 after)."""
    from safetensors.torch import load_file, save_file

    from specbook.drafters.eagle3 import load_eagle3
    from specbook.models import provision
    from specbook.train import CKPT_DIR

    env_py = subprocess.run(["bash", str(ROOT / "scripts" / "speculators_env.sh")], check=True, capture_output=True,
                            text=True, timeout=1800).stdout.strip().splitlines()[-1]
    target, tok = real
    local = provision("smollm2-135m-instruct")
    out = export("eagle3", tmp_path / "e3", verifier=str(local))
    head, card = load_eagle3(target, CKPT_DIR / "eagle3")
    head = head.float()
    text = "Speculative decoding drafts a few tokens cheaply and lets the target check them all in one forward."
    ids = tok(text, return_tensors="pt").input_ids
    S, steps = ids.shape[1] - 1, 3
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    fused = torch.cat([hs[t][:, :S] for t in head.taps], -1)
    save_file({"fused": fused.contiguous(), "input_ids": ids[:, 1:].contiguous(), "steps": torch.tensor([steps])},
              str(tmp_path / "in.safetensors"))
    run = subprocess.run([env_py, str(ROOT / "scripts" / "check_speculators.py"), str(out), str(tmp_path / "in.safetensors"),
                          str(tmp_path / "theirs.safetensors")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    assert theirs["aux_layer_ids"].tolist() == list(head.taps) == card["config"]["taps"]
    assert torch.equal(theirs["d2t"], head.d2t.cpu()) and torch.equal(theirs["t2d"], head.t2d.cpu())
    E = load_file(str(out / "model.safetensors"))["embed_tokens.weight"].float()  # the weights both sides hold
    with torch.no_grad():
        emb = E[torch.cat([ids[0, 1:], ids.new_zeros(steps)])][None]
        ours = [head.logits(h)[0] for h in head.unroll(emb, fused, steps)]
    for i in range(steps):
        n = S - i  # speculators pads the shifted ids at the end; positions past them are not comparable
        torch.testing.assert_close(theirs[f"logits_{i}"][:n], ours[i][:n], atol=1e-4, rtol=0)
        assert torch.equal(theirs[f"logits_{i}"][:n].argmax(-1), ours[i][:n].argmax(-1))
