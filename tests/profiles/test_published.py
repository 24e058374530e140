"""Published figures as tests (bench/published.py prints them at full size): Korthikanti et al. 2022's bytes per
transformer layer, with and without dropout, math and fused attention, estimated for an H100 to the byte (once
each LayerNorm's fp32 statistics, which the paper leaves out, are added). ZeRO's Figure 1:
tests/planner/test_training_setup.py."""

import pytest

from paths import ROOT, load_module

published = load_module(ROOT / "bench" / "published.py", "published")

H, A, S, B = 512, 8, 1024, 4  # every tensor a whole number of the allocator's 2 MiB blocks


@pytest.mark.parametrize("dropout, attention", [(True, "math"), (False, "math"), (False, "sdpa")])
def test_a_megatron_layer_keeps_what_korthikanti_et_al_itemise(dropout, attention):
    stage = published.estimated_layer(H, A, S, B, dropout, attention)
    layer_norm_statistics = 2 * 2 * 4 * S * B  # two LayerNorms, mean and reciprocal deviation, fp32 per row
    assert stage.saved_bytes == published.formula(H, A, S, B, dropout, attention) + layer_norm_statistics
    assert stage.out_bytes == 2 * S * B * H  # all that full recomputation keeps of it: its input to the next

