"""Head-sharded attention (jaxtp.model.attention): QKV column-parallel by
heads, the output row-parallel, at tp 1, 2, 8 (GQA kv heads sharded at
tp 2, replicated at 8) under shard_map and gspmd, equal to one device in
value and every gradient."""

import pytest

from modules import CASES, check_module


@pytest.mark.parametrize("style, tp", CASES)
def test_attention_matches_gspmd_and_reference(style, tp):
    check_module("attention", tp, style)


test_attention_matches_gspmd_and_reference.fast_cases = {"llama-8"}


@pytest.mark.parametrize("tp", [2, 8])
def test_qk_norm_and_a_head_dim_apart_from_d_model_over_n_heads(tp):
    """Qwen3's attention (H = 16 at D = 64, N = 8; q and k RMS-normalised per
    head before RoPE, the two [H] scales replicated): under gspmd, shard_map
    and explicit, the 2 kv heads sharded at tp 2 and replicated at 8, output,
    dX and every gradient, the norms' scales included, equal the reference."""
    check_module("attention", tp, "qwen3", impls=("shard_map", "gspmd", "explicit"))


test_qk_norm_and_a_head_dim_apart_from_d_model_over_n_heads.fast_cases = {"8"}
