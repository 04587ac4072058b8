"""Config auto-completion and checking against a model file's signature (pure, no files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuserve.backends.signature import ModelSignature, ModelTensor, complete_config
from gpuserve.config import ModelConfig, parse_model_config
from gpuserve.errors import ConfigError

PATH = Path("/repo/m/config.yaml")


def config(**fields) -> ModelConfig:
    return parse_model_config({"backend": "onnx", **fields}, PATH, "m")


def spec(name, datatype="FP32", shape=(8,)):
    return {"name": name, "datatype": datatype, "shape": list(shape)}


def signature(inputs=None, outputs=None, **kw) -> ModelSignature:
    return ModelSignature(
        source="model.onnx",
        inputs=inputs if inputs is not None else [ModelTensor("INPUT0", "FP32", (None, 8))],
        outputs=outputs if outputs is not None else [ModelTensor("OUTPUT0", "FP32", (None, 4))],
        **kw,
    )


def errors_of(cfg, sig) -> str:
    with pytest.raises(ConfigError) as info:
        complete_config(cfg, sig, PATH)
    text = info.value.message
    assert text.startswith(f"{PATH}: does not match model.onnx:")
    return text


def tensors(specs):
    return [(s.name, s.datatype, list(s.shape)) for s in specs]


def test_omitted_inputs_and_outputs_are_filled_in():
    done = complete_config(config(), signature(), PATH)
    assert done.max_batch_size == 8
    assert tensors(done.inputs) == [("INPUT0", "FP32", [8])]
    assert tensors(done.outputs) == [("OUTPUT0", "FP32", [4])]
    assert done.name == "m"


def test_dynamic_non_batch_dims_become_minus_one():
    sig = signature(
        inputs=[
            ModelTensor("ids", "INT64", (None, None)),
            ModelTensor("mask", "INT64", (None, None)),
        ],
        outputs=[ModelTensor("emb", "FP32", (None, 384))],
    )
    done = complete_config(config(max_batch_size=4), sig, PATH)
    assert tensors(done.inputs) == [("ids", "INT64", [-1]), ("mask", "INT64", [-1])]
    assert tensors(done.outputs) == [("emb", "FP32", [384])]


def test_unset_max_batch_size_becomes_zero_for_a_fixed_first_dim():
    sig = signature(
        inputs=[ModelTensor("INPUT0", "FP32", (1, 8))], outputs=[ModelTensor("OUT", "FP32", (1, 4))]
    )
    done = complete_config(config(), sig, PATH)
    assert done.max_batch_size == 0
    assert tensors(done.inputs) == [("INPUT0", "FP32", [1, 8])]


def test_unset_max_batch_size_is_capped_by_the_model():
    done = complete_config(config(), signature(max_batch=4), PATH)
    assert done.max_batch_size == 4


def test_explicit_zero_keeps_full_shapes():
    done = complete_config(config(max_batch_size=0), signature(), PATH)
    assert tensors(done.inputs) == [("INPUT0", "FP32", [-1, 8])]


def test_a_partial_declaration_completes_the_other_side():
    done = complete_config(config(inputs=[spec("INPUT0")]), signature(), PATH)
    assert tensors(done.outputs) == [("OUTPUT0", "FP32", [4])]


def test_agreeing_declaration_is_kept():
    cfg = config(inputs=[spec("INPUT0")], outputs=[spec("OUTPUT0", shape=(4,))])
    assert complete_config(cfg, signature(), PATH).inputs == cfg.inputs


def test_a_dynamic_model_dim_may_be_declared_fixed():
    sig = signature(inputs=[ModelTensor("INPUT0", "FP32", (None, None))])
    cfg = config(inputs=[spec("INPUT0", shape=(16,))])
    assert tensors(complete_config(cfg, sig, PATH).inputs) == [("INPUT0", "FP32", [16])]


def test_datatype_disagreement_names_both():
    text = errors_of(config(inputs=[spec("INPUT0", "FP16")]), signature())
    assert "input 'INPUT0': config.yaml declares datatype FP16, but model.onnx has FP32" in text


def test_shape_disagreement_names_both():
    text = errors_of(config(outputs=[spec("OUTPUT0", shape=(5,))]), signature())
    assert "output 'OUTPUT0': config.yaml declares shape [5], but model.onnx has [4]" in text


def test_variable_declared_where_the_model_is_fixed_is_refused():
    text = errors_of(config(inputs=[spec("INPUT0", shape=(-1,))]), signature())
    assert "declares shape [-1], but model.onnx has [8]" in text


def test_rank_disagreement_is_refused():
    text = errors_of(config(inputs=[spec("INPUT0", shape=(2, 4))]), signature())
    assert "declares shape [2, 4], but model.onnx has [8]" in text


def test_unknown_and_undeclared_names_are_both_reported():
    text = errors_of(config(inputs=[spec("IN")], outputs=[spec("OUT", shape=(4,))]), signature())
    assert "input 'IN': declared in config.yaml, but model.onnx has no such input" in text
    assert "(its inputs: ['INPUT0'])" in text
    assert "input 'INPUT0': model.onnx needs it, but config.yaml does not declare it" in text
    assert "output 'OUT': declared in config.yaml, but model.onnx has no such output" in text


def test_declared_outputs_may_be_a_subset_by_name():
    sig = signature(
        outputs=[ModelTensor("A", "FP32", (None, 4)), ModelTensor("B", "FP32", (None,))]
    )
    done = complete_config(config(outputs=[spec("B", shape=())]), sig, PATH)
    assert tensors(done.outputs) == [("B", "FP32", [])]


def test_positional_inputs_match_by_order_not_name():
    sig = signature(inputs=[ModelTensor("x", "FP32", (None, 8))], inputs_by_name=False)
    done = complete_config(config(inputs=[spec("INPUT0")]), sig, PATH)
    assert tensors(done.inputs) == [("INPUT0", "FP32", [8])]
    text = errors_of(config(inputs=[spec("INPUT0", "INT64")]), sig)
    assert (
        "input 'INPUT0' (model.onnx input 'x', by position): config.yaml declares datatype " in text
    )


def test_positional_count_disagreement():
    sig = signature(inputs_by_name=False)
    text = errors_of(config(inputs=[spec("A"), spec("B")]), sig)
    assert "config.yaml declares 2 input(s) ['A', 'B'], but model.onnx has 1 ['INPUT0']" in text


def test_batching_needs_a_dynamic_first_dimension():
    sig = signature(inputs=[ModelTensor("INPUT0", "FP32", (2, 8))])
    text = errors_of(config(max_batch_size=8), sig)
    assert "input 'INPUT0': model.onnx has shape [2, 8] with no dynamic first dimension" in text
    assert "max_batch_size: 8" in text


def test_max_batch_size_above_the_model_limit_is_refused():
    text = errors_of(config(max_batch_size=16), signature(max_batch=8))
    assert "max_batch_size: 16, but model.onnx accepts batches of at most 8 rows" in text


def test_a_type_without_v2_datatype_cannot_be_completed():
    sig = signature(inputs=[ModelTensor("INPUT0", "tensor(bfloat16)", (None, 8))])
    text = errors_of(config(), sig)
    assert "input 'INPUT0': model.onnx has type tensor(bfloat16), which has no KServe V2" in text


def test_completed_config_is_validated_again():
    cfg = config(dynamic_batching={"preferred_batch_sizes": [8]})
    text = errors_of(cfg, signature(max_batch=4))
    assert "preferred_batch_sizes entry 8 exceeds max_batch_size=4" in text


def test_python_backend_needs_declarations_at_load_without_a_completion_hook(tmp_path):
    from gpuserve.backends.triton_python.backend import PythonModelBackend

    cfg = parse_model_config({"backend": "python", "outputs": [spec("O")]}, PATH, "m")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text("class Model:\n    pass\n")
    with pytest.raises(ConfigError) as info:
        PythonModelBackend.complete_config(cfg, tmp_path / "1")
    assert "model 'm' declares no inputs: backend 'python' needs them" in info.value.message


def test_onnx_section_validates_providers():
    assert config().onnx.execution_providers == ["tensorrt", "cuda", "cpu"]
    with pytest.raises(ConfigError) as info:
        config(onnx={"execution_providers": ["cuda", "cuda"]})
    assert "each provider may be listed once" in info.value.message
    with pytest.raises(ConfigError):
        config(onnx={"execution_providers": ["rocm"]})
    with pytest.raises(ConfigError):
        config(onnx={"graph_optimization_level": "max"})
