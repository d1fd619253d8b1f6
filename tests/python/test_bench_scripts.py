"""The benchmark scripts under bench/ label what they measured: the layer plot names the recipe
moekit ran (from `moekit bench layer`'s JSON) and the baseline's own, not one for both."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def torch_layer_module():
    """bench/torch_layer.py as a module (it needs torch: skipped without it)."""
    pytest.importorskip("torch")
    sys.path.insert(0, BENCH)
    try:
        import torch_layer
    finally:
        sys.path.remove(BENCH)
    return torch_layer


@pytest.mark.parametrize("recipe", ["block128", "per-token"])
def test_layer_plot_names_the_recipe_moekit_ran(recipe):
    torch_layer = torch_layer_module()
    xlabel, curves = torch_layer.plot_labels({"quant": recipe})
    assert f"moekit {recipe}" in xlabel and "PyTorch per-token FP8" in xlabel, xlabel
    assert curves["batched-fp8"] == f"moekit batched-fp8 ({recipe})", curves


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_layer_baseline_runs_bf16_against_bf16(dtype):
    """An unquantized moekit run is measured against PyTorch's layer in the same dtype, and labelled so."""
    torch_layer = torch_layer_module()
    res = {"quant": dtype, "model": "qwen3-30b-a3b", "E": 128, "topk": 8}
    assert torch_layer.baseline_recipe(res) == dtype
    xlabel, _ = torch_layer.plot_labels(res)
    assert f"moekit {dtype}" in xlabel and f"PyTorch {dtype}" in xlabel and "qwen3-30b-a3b" in xlabel, xlabel
    assert torch_layer.ROUTING["qwen3-30b-a3b"] is None and torch_layer.ROUTING["deepseek-v3"] == (8, 4, 2.5)
