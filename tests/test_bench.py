import json

import pytest

from specbook import bench
from specbook.prompts import load_prompts


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown method"):
        bench.run_bench(["nope"], [{"turns": ["hi"]}], model=object(), tokenizer=object())


def test_prompt_loading_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"question_id": 1, "turns": []}\n')
    with pytest.raises(ValueError, match="turns"):
        load_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "missing.jsonl")


def test_prompt_set_shape():
    tr, ev = load_prompts("train"), load_prompts("eval")
    assert len(tr) + len(ev) > 3000
    cats = {r["category"] for r in tr}
    assert cats == {"multi_turn", "writing", "translation", "summarization", "qa", "math_reasoning", "coding", "rag"}
    assert not {tuple(r["turns"]) for r in tr} & {tuple(r["turns"]) for r in ev}, "eval must never be trained on"


@pytest.mark.slow
def test_bench_cli_json_contract(tmp_path, real, monkeypatch):
    model, tok = real
    prompts = load_prompts("eval", limit=2)
    res = bench.run_bench(["hf_generate"], prompts, max_new_tokens=6, model=model, tokenizer=tok, progress=False)
    assert set(res) >= {"machine", "settings", "rows"}
    for r in res["rows"]:
        assert set(r) >= {"method", "tokens_per_s", "tau", "speedup", "target_forwards", "new_tokens", "peak_mem_mb"}
    ar = next(r for r in res["rows"] if r["method"] == "ar")
    assert ar["speedup"] == 1.0 and ar["tau"] == 1.0
    # the CLI end to end (same model through the loader)
    out = tmp_path / "b.json"
    bench.main(["--methods", "ar", "--limit", "1", "--max-new-tokens", "4", "--dtype", "fp32", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"][0]["method"] == "ar" and "command" in data["settings"]
