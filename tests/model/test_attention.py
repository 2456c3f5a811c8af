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
