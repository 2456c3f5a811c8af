"""The MLP (jaxtp.model.mlp): column-parallel up (and gate), row-parallel
down, at tp 1, 2, 8 under shard_map and gspmd, equal to one device in
value and every gradient (a row-parallel bias added before the reduction
would show)."""

import pytest

from modules import CASES, check_module


@pytest.mark.parametrize("style, tp", CASES)
def test_mlp_matches_gspmd_and_reference(style, tp):
    check_module("mlp", tp, style)


test_mlp_matches_gspmd_and_reference.fast_cases = {"gpt2-8"}
