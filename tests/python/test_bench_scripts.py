"""The benchmark scripts under bench/ label what they measured: the layer plot names the recipe
moekit ran (from `moekit bench layer`'s JSON) and the baseline's own, not one for both."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.mark.parametrize("recipe", ["block128", "per-token"])
def test_layer_plot_names_the_recipe_moekit_ran(recipe):
    pytest.importorskip("torch")
    sys.path.insert(0, BENCH)
    try:
        import torch_layer
    finally:
        sys.path.remove(BENCH)
    xlabel, curves = torch_layer.plot_labels({"quant": recipe})
    assert f"moekit {recipe}" in xlabel and "PyTorch per-token FP8" in xlabel, xlabel
    assert curves["batched-fp8"] == f"moekit batched-fp8 ({recipe})", curves
