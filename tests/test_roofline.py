import math

import pytest
from transformers import LlamaConfig

from specbook import roofline as rl


def smol_config():
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)


def test_param_count_matches_smollm2():
    pc = rl.param_counts(smol_config())
    total = pc["layers"] + pc["embedding"] + pc["lm_head"] + pc["final_norm"]
    assert total == 134_515_008  # LlamaForCausalLM(SmolLM2-135M).num_parameters()


def test_100b_model_on_h100_is_tens_of_ms_per_token():
    ms = 1e3 / rl.bound_tokens_per_s(100e9, 2, rl.DATASHEET["H100 SXM"].bandwidth_gbs)
    assert 50 < ms < 70


def test_intensity_grows_with_k_and_batch():
    cfg = smol_config()
    i1 = rl.decode_step_cost(cfg, 1, 1).intensity
    assert 0.5 < i1 < 1.5  # ~1 FLOP/byte in 16-bit
    assert rl.decode_step_cost(cfg, 1, 8).intensity > 7 * i1
    assert rl.decode_step_cost(cfg, 8, 1).intensity > 5 * i1


def test_roofline_and_ridge():
    assert rl.attainable_tflops(1.0, 1000, 100) == pytest.approx(1.0)
    assert rl.attainable_tflops(1e6, 1000, 100) == 100
    assert rl.ridge_point(1000, 100) == pytest.approx(100)


def test_leviathan_formula():
    assert rl.expected_tokens_per_step(0.0, 5) == 1.0
    assert rl.expected_tokens_per_step(1.0, 5) == 6.0
    assert rl.expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert rl.expected_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    assert rl.expected_speedup(0.5, 2, 0.5) == pytest.approx(1.75 / 2)
    with pytest.raises(ValueError, match="alpha"):
        rl.expected_tokens_per_step(1.2, 2)
    with pytest.raises(ValueError, match="c must"):
        rl.expected_speedup(0.5, 2, -1)


def test_speedup_with_a_measured_latency_curve():
    """A flat latency curve is Leviathan's assumption (verification = one target step); a rising one charges the
    verification forward: by hand at alpha 0.5, gamma 2 (E = 1.75), c 0.1, latency(3) = 1.5 x latency(1)."""
    flat = {1: 0.02, 4: 0.02, 16: 0.02}
    for a, g, c in ((0.5, 2, 0.1), (0.8, 5, 0.05), (0.9, 1, 0.0)):
        assert rl.speedup_with_latency(a, g, c, flat) == pytest.approx(rl.expected_speedup(a, g, c))
    rising = {1: 0.02, 2: 0.025, 4: 0.035}  # latency(3) = 0.03 by interpolation
    assert rl.speedup_with_latency(0.5, 2, 0.1, rising) == pytest.approx(1.75 / (0.2 + 1.5))
    with pytest.raises(ValueError, match="c must"):
        rl.speedup_with_latency(0.5, 2, -0.1, flat)


def test_optimal_gamma_grows_with_alpha_and_shrinks_with_cost():
    assert rl.optimal_gamma(0.5, 0.1) < rl.optimal_gamma(0.9, 0.1)
    assert rl.optimal_gamma(0.9, 0.5) < rl.optimal_gamma(0.9, 0.01)
    best = rl.optimal_gamma(0.8, 0.1)
    assert all(rl.expected_speedup(0.8, best, 0.1) >= rl.expected_speedup(0.8, g, 0.1) for g in range(1, 33))
    steep = {1: 1.0, 2: 2.0, 64: 64.0}  # verification as dear as sequential steps: one draft token at most
    assert rl.optimal_gamma(0.9, 0.1, steep) <= rl.optimal_gamma(0.9, 0.1)


def test_datasheet_has_sources():
    for name in ("H100 SXM", "H200 SXM", "A100 80GB SXM", "L4", "RTX 4090"):
        acc = rl.DATASHEET[name]
        assert acc.bandwidth_gbs > 0 and acc.tflops_bf16 > 0 and "datasheet" in acc.source.lower() \
            or "whitepaper" in acc.source.lower()


def test_measurements_are_positive():
    assert rl.measure_bandwidth(16, repeats=1) > 0
    assert rl.measure_matmul_tflops(128, repeats=1) > 0


def test_latency_profile_on_tiny(tiny):
    lat = rl.profile_latency_vs_k(tiny, ks=(1, 4), context=8, repeats=1)
    assert set(lat) == {1, 4} and all(v > 0 for v in lat.values())


def test_latency_profile_runs_in_rounds_over_every_k(tiny):
    """One prefill, then a warm-up round and ``repeats`` timed rounds, each over every k in turn (not every repeat
    of one k back to back, which lets a slow spell of the machine bend one point of the curve); each timed forward
    sees the same cached context."""
    seen = []

    def record(mod, args, kw):
        cache = next(v for v in kw.values() if hasattr(v, "get_seq_length"))
        seen.append((kw["input_ids"].shape[1], cache.get_seq_length()))

    hook = tiny.register_forward_pre_hook(record, with_kwargs=True)
    try:
        lat = rl.profile_latency_vs_k(tiny, ks=(1, 2, 4), context=8, repeats=2)
    finally:
        hook.remove()
    assert seen == [(8, 0)] + [(k, 8) for _ in range(3) for k in (1, 2, 4)]
    assert set(lat) == {1, 2, 4} and all(0 < v < float("inf") for v in lat.values())


def test_median_seconds_warms_up_resets_and_takes_the_median():
    from specbook.roofline import median_seconds

    calls, resets = [], []
    t = median_seconds(lambda: calls.append(1), repeats=3, reset=lambda: resets.append(1))
    assert len(calls) == 4 and len(resets) == 4 and 0 <= t < 0.1


def test_sram_machines_have_sources_capacity_and_a_low_ridge():
    for name, acc in rl.SRAM_DATASHEET.items():
        assert acc.memory_gb and acc.bandwidth_gbs > 0 and acc.tflops_bf16 > 0 and name.split()[0] in acc.source
        # the SRAM machines' ridge sits left of ~10 FLOP/byte, every HBM GPU's right of 100: verification is no
        # longer free after a handful of tokens
        assert rl.ridge_point(acc.bandwidth_gbs, acc.tflops_bf16) < 10
    assert all(rl.ridge_point(a.bandwidth_gbs, a.tflops_bf16) > 100 for a in rl.DATASHEET.values())


def test_chips_needed_counts_sram_capacity():
    p = rl.param_counts(rl.LLAMA_70B)
    params = p["layers"] + p["embedding"] + p["lm_head"]
    assert 70e9 < params < 71e9  # Llama-3.1-70B's published size
    groq = rl.SRAM_DATASHEET["Groq LPU"]
    assert rl.chips_needed(params, 2, groq) == math.ceil(params * 2 / 0.23e9)
    assert rl.chips_needed(params, 2, rl.DATASHEET["H100 SXM"]) == 1  # HBM: capacity not modelled


def test_roofline_latency_is_flat_left_of_the_ridge_and_linear_right_of_it():
    lat = rl.roofline_latency(rl.LLAMA_70B, rl.DATASHEET["H100 SXM"], ks=(1, 8, 64))
    assert lat[64] / lat[1] < 1.1  # far left of the H100's ridge: 64 tokens cost about one
    lat = rl.roofline_latency(rl.LLAMA_70B, rl.SRAM_DATASHEET["Groq LPU"], ks=(1, 32, 64))
    assert 1.9 < lat[64] / lat[32] < 2.1  # compute bound: twice the tokens, twice the time
    # and a speculative step priced by it pays less where verification is dear
    fast = rl.speedup_with_latency(0.8, 7, 0.05, rl.roofline_latency(rl.LLAMA_70B, rl.DATASHEET["H100 SXM"]))
    sram = rl.speedup_with_latency(0.8, 7, 0.05, rl.roofline_latency(rl.LLAMA_70B, rl.SRAM_DATASHEET["Groq LPU"]))
    assert sram < fast


def test_latency_table_equals_interpolating_each_size():
    """The tree-size rules read latency(n) from one table per curve; it must equal interp_latency at every size
    (below the first point, between points, beyond the last), and a changed curve must not reuse an old table."""
    from specbook.roofline import interp_latency, latency_table

    curve = {1: 0.02, 2: 0.021, 8: 0.025, 16: 0.03}
    assert latency_table(curve, 40) == tuple(interp_latency(curve, n) for n in range(41))
    steeper = {**curve, 16: 0.06}
    assert latency_table(steeper, 40)[30] == interp_latency(steeper, 30) != latency_table(curve, 40)[30]
