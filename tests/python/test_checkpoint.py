"""Checkpoints as the safetensors package writes them (the format's own writer, torch and NumPy
dtypes, shards with an index as transformers' save_pretrained writes them) read by moekit's reader:
every name, dtype, shape and byte the same; untrusted checkpoints refused by name through the binding."""
import json
import os

import numpy as np
import pytest

import moekit

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def test_single_file_from_the_safetensors_writer(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {
        "model.layers.3.mlp.experts.0.gate_proj.weight": rng.integers(0, 255, (256, 128), dtype=np.uint8),
        "model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv": rng.random((2, 1), dtype=np.float32),
        "model.layers.3.mlp.gate.e_score_correction_bias": rng.random(8).astype(np.float32),
        "scalar": np.array(3.5, np.float64),
        "empty": np.zeros((0, 4), np.int64),
        "halves": rng.random((3, 5)).astype(np.float16),
    }
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    got = moekit._moekit.checkpoint_tensors(str(path))
    assert set(got) == set(tensors)
    names = {np.uint8: "U8", np.float32: "F32", np.float64: "F64", np.int64: "I64", np.float16: "F16"}
    for name, array in tensors.items():
        dtype, shape, data = got[name]
        assert dtype == names[array.dtype.type] and list(shape) == list(array.shape), name
        assert data == array.tobytes(), name


def test_torch_dtypes_and_shards_with_an_index(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(2)
    shard1 = {"w1": torch.randn(4, 8, generator=g).to(torch.bfloat16),
              "w1_fp8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn)}
    shard2 = {"w2": torch.randn(8, 2, generator=g), "ids": torch.arange(5, dtype=torch.int32)}
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for shard, file in zip((shard1, shard2), names):
        safetensors_torch.save_file(shard, str(tmp_path / file))
    index = {"metadata": {"total_size": 0},
             "weight_map": {**{k: names[0] for k in shard1}, **{k: names[1] for k in shard2}}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = moekit._moekit.checkpoint_tensors(str(tmp_path))
    expect = {"w1": "BF16", "w1_fp8": "F8_E4M3", "w2": "F32", "ids": "I32"}
    for name, t in {**shard1, **shard2}.items():
        dtype, shape, data = got[name]
        assert dtype == expect[name] and list(shape) == list(t.shape)
        assert data == t.contiguous().view(torch.uint8).numpy().tobytes(), name
    # A shard the index points outside the directory is refused, naming it.
    index["weight_map"]["w2"] = "../" + names[1]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(moekit.Error, match="no path separators"):
        moekit._moekit.checkpoint_tensors(str(tmp_path))


def _tiny_qwen(path, edit=None):
    """A Qwen3-MoE checkpoint of fp32 tensors (K = 64, I = 32, 4 experts) written by safetensors."""
    rng = np.random.default_rng(3)
    config = {"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 1,
              "num_experts": 4, "num_experts_per_tok": 2}
    p = "model.layers.0.mlp."
    tensors = {p + "gate.weight": rng.standard_normal((4, 64), dtype=np.float32)}
    for e in range(4):
        for w, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
            tensors[f"{p}experts.{e}.{w}.weight"] = 0.05 * rng.standard_normal(shape, dtype=np.float32)
    if edit:
        edit(tensors)
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"))
    return path


def test_untrusted_checkpoints_are_refused_by_name(tmp_path):
    """The binding reads checkpoints through the same checks as the CLI: a bad value is named by shard,
    tensor and element; a FIFO is never opened; a tensor named twice in the index is refused."""
    ck = moekit.Checkpoint(_tiny_qwen(tmp_path / "good"))
    # fp32 tensors, no quantization_config: quant="auto" runs them in bf16; FP8 is asked for.
    assert ck.load_layer(0).note.endswith("rounded once to bf16 at load (unquantized)")
    assert ck.load_layer(0, quant="per-token").note.endswith("quantized to per-token at load")

    def nan(t):
        t["model.layers.0.mlp.experts.2.down_proj.weight"][5, 7] = np.nan

    bad = moekit.Checkpoint(_tiny_qwen(tmp_path / "nan", nan))
    with pytest.raises(moekit.Error, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.experts\.2\.down_proj"
                                           r"\.weight' element \[5, 7\] \(flat index 167\) is NaN"):
        bad.load_layer(0)

    fifo = _tiny_qwen(tmp_path / "fifo")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    with pytest.raises(moekit.Error, match="is a FIFO"):
        moekit.Checkpoint(fifo)

    twice = _tiny_qwen(tmp_path / "twice")
    name = "model.layers.0.mlp.gate.weight"
    (twice / "model.safetensors.index.json").write_text(
        '{"weight_map": {"%s": "model.safetensors", "%s": "model.safetensors"}}' % (name, name))
    with pytest.raises(moekit.Error, match=f"key '{name}' is given twice in 'weight_map'"):
        moekit.Checkpoint(twice)
