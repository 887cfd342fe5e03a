"""endpoints/ascend_rules.py: which ModelSlim artifact an Ascend chip can serve, and in which dtype (vllm-ascend
v0.23.0's 310P loader and w8a8_static.py's deq_scale packing). The checkpoints are real msModelSlim output on tiny
Llamas, finished as the quantize job finishes them (tests/support/quantize.make_checkpoint)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from endpoints.ascend_rules import artifact_node_refusal, launch_refusal, refusal_errors
from models_registry.inspection import inspect_path
from models_registry.models import Artifact, Model
from models_registry.quantize import modelslim
from models_registry.quantize.modelslim_facts import MIXED, modelslim_facts
from tests.support.quantize import make_checkpoint


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One directory per kind, made once: {name: path}."""
    kinds = {
        "w8a8-bf16": {},
        "w8a8-fp16": {"dtype": "float16"},
        "w8a16-bf16": {"scheme": "w8a16"},
        "dynamic-bf16": {"scheme": "w8a8_dynamic"},
    }
    return {name: make_checkpoint(tmp_path_factory.mktemp(name), **kw) for name, kw in kinds.items()}


def refusal(path, *, chip, dtype=None, fmt="ascend-modelslim"):
    return artifact_node_refusal(artifact_format=fmt, **modelslim_facts(path), chip_name=chip, endpoint_dtype=dtype)


def test_the_checkpoint_dtype_comes_from_deq_scale_in_the_headers(made):
    """What the console records says the scheme, not the dtype written: it is read from deq_scale's dtype."""
    for name, dtype in (("w8a8-bf16", "bfloat16"), ("w8a8-fp16", "float16")):
        assert inspect_path(made[name])["dtype"] == "W8A8"  # the recorded "dtype" is the scheme
        facts = modelslim_facts(made[name])
        assert facts["checkpoint_dtype"] == dtype
        assert facts["quant_description"] == json.loads((made[name] / modelslim.DESCRIPTION).read_text())
    for name in ("w8a16-bf16", "dynamic-bf16"):  # no W8A8 static layer, no deq_scale
        assert modelslim_facts(made[name])["checkpoint_dtype"] is None


def test_w8a16_on_310p_is_refused_and_says_how_to_produce_one(made):
    said = refusal(made["w8a16-bf16"], chip="310P3")
    assert said.startswith("artifact: W8A16 linear layers (model.layers.0.self_attn.q_proj, …) on a 310P3 chip")
    assert "AscendModelSlimConfig310" in said and "NotImplementedError" in said
    assert "(it has W8A8, W8A8_DYNAMIC, W8A8S, W8A8SC)" in said
    assert "Produce it for 310P: quantize the float parent with scheme w8a8_dynamic" in said
    assert "the quantize job has no float16 or 310P option" in said
    assert refusal(made["w8a16-bf16"], chip="910B4") == ""  # the other chips have W8A16 (methods/w8a16.py)
    assert refusal(made["w8a16-bf16"], chip="Ascend310P1").startswith("artifact: W8A16")  # npu-smi's spelling
    assert refusal(made["w8a16-bf16"], chip="310P3", fmt="hf") == ""  # the rules are ModelSlim's loader's


def test_bf16_w8a8_on_310p_is_refused_and_fp16_is_served(made):
    said = refusal(made["w8a8-bf16"], chip="310P3")
    assert said.startswith("artifact: a bfloat16 W8A8 checkpoint (deq_scale float32) on a 310P3 chip")
    assert "creates deq_scale int64" in said and "runs float16" in said
    assert "convert the float parent to float16 first (convert target fp16)" in said
    assert refusal(made["w8a8-fp16"], chip="310P3") == ""
    assert refusal(made["w8a8-fp16"], chip="310P3", dtype="auto") == ""  # forced to float16 there
    assert refusal(made["dynamic-bf16"], chip="310P3") == ""  # W8A8_DYNAMIC: float32 scales, cast by copy_


def test_endpoint_dtype_must_match_a_w8a8_checkpoints(made):
    said = refusal(made["w8a8-bf16"], chip="910B4", dtype="float16")
    assert said.startswith("dtype: float16 for a bfloat16 W8A8 checkpoint")
    assert "creates deq_scale int64 for a float16 model where this checkpoint's is float32" in said
    said = refusal(made["w8a8-fp16"], chip="910B4", dtype="bfloat16")
    assert said.startswith("dtype: bfloat16 for a float16 W8A8 checkpoint")
    assert "creates deq_scale float32 for a bfloat16 model where this checkpoint's is int64" in said
    assert "no deq_scale at all" in refusal(made["w8a8-bf16"], chip="910B4", dtype="float32")
    for same in ("bfloat16", "bf16", "auto", "", None):
        assert refusal(made["w8a8-bf16"], chip="910B4", dtype=same) == "", same
    # no deq_scale, nothing packed: W8A8 dynamic and W8A16 run in either dtype
    assert refusal(made["dynamic-bf16"], chip="910B4", dtype="float16") == ""
    assert refusal(made["w8a16-bf16"], chip="910B4", dtype="float16") == ""


def test_a_quantized_lm_head_on_310p_is_refused(made, tmp_path):
    out = tmp_path / "q-lm-head"
    shutil.copytree(made["w8a8-fp16"], out)
    desc = json.loads((out / modelslim.DESCRIPTION).read_text())
    desc["lm_head.weight"] = "W8A8"
    (out / modelslim.DESCRIPTION).write_text(json.dumps(desc))
    said = refusal(out, chip="310P3")
    assert said.startswith("artifact: quantized lm_head on a 310P3 chip")
    assert "AscendUnquantizedEmbeddingMethod310" in said


def test_deq_scale_in_both_packings_is_refused_everywhere(made, tmp_path):
    out = tmp_path / "mixed"
    shutil.copytree(made["w8a8-bf16"], out)
    weights = out / modelslim.WEIGHT_FILE["W8A8"]
    tensors = load_file(str(weights))
    name = "model.layers.0.self_attn.q_proj.deq_scale"
    tensors[name] = tensors[name].view(torch.int32).to(torch.int64)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert modelslim_facts(out)["checkpoint_dtype"] == MIXED
    assert refusal(out, chip="910B4").startswith("artifact: a W8A8 checkpoint with deq_scale in both packings")
    assert refusal(out, chip="310P3").startswith("artifact: a mixed W8A8 checkpoint (deq_scale in both packings)")


@pytest.mark.django_db
def test_launch_refusal_reads_an_artifacts_directory(made, settings, tmp_path):
    settings.ARTIFACT_STORE = tmp_path.resolve()
    store = tmp_path / "w8a8-bf16"
    shutil.copytree(made["w8a8-bf16"], store)
    model = Model.objects.create(name="tiny")
    artifact = Artifact.objects.create(
        model=model, format="ascend-modelslim", dtype="W8A8", path=str(store), inspection=inspect_path(store)
    )
    said = launch_refusal(artifact=artifact, chip_name="910B4", endpoint_dtype="float16")
    assert refusal_errors(said) == {"dtype": said.removeprefix("dtype: ")}
    assert launch_refusal(artifact=artifact, chip_name="910B4", endpoint_dtype="") == ""
    assert refusal_errors(launch_refusal(artifact=artifact, chip_name="310P3", endpoint_dtype="")).keys() == {
        "artifact"
    }
    hf = Artifact.objects.create(model=model, format="hf", dtype="bfloat16", path=str(tmp_path / "nowhere"))
    assert launch_refusal(artifact=hf, chip_name="310P3", endpoint_dtype="bfloat16") == ""


@pytest.mark.django_db
def test_the_launch_refuses_both_and_changes_nothing(made, settings, tmp_path, operator):
    """The rules at the launch (endpoints.services.endpoint_create, which the API and the form call), on a node of
    each chip: a bf16 W8A8 checkpoint on a 310P node, and a float16 endpoint over it on a 910B node, are refused
    naming the field; nothing is made. (The service, not the API client: msModelSlim, which made these checkpoints,
    replaces pydantic.BaseModel on import (msmodelslim/utils/patch/pydantic), after which django-ninja no longer
    knows a request body loaded later in the same process.)"""
    from django.core.exceptions import ValidationError
    from django.utils import timezone

    from endpoints.endpoint_spec import EndpointSpec
    from endpoints.models import Endpoint
    from endpoints.preview import endpoint_preview
    from endpoints.services import endpoint_create
    from workers.models import Device, Node

    settings.ARTIFACT_STORE = tmp_path.resolve()
    store = tmp_path / "w8a8-bf16"
    shutil.copytree(made["w8a8-bf16"], store)
    artifact = Artifact.objects.create(
        model=Model.objects.create(name="tiny"),
        format="ascend-modelslim",
        dtype="W8A8",
        path=str(store),
        inspection=inspect_path(store),
    )
    for name, chip in (("duo", "310P3"), ("a2", "910B4")):
        node = Node.objects.create(
            name=name,
            hostname=name,
            address="10.0.0.9",
            platform="ascend",
            engine_python="/opt/engine/bin/python",
            last_heartbeat=timezone.now(),
        )
        Device.objects.create(node=node, index=0, kind="npu", name=chip, memory_total_bytes=32 * 1024**3, health="OK")
    with pytest.raises(ValidationError) as on_310p:
        endpoint_create(spec=EndpointSpec(name="e1", artifact=artifact.pk, node="duo", devices=[0]), user=operator)
    assert list(on_310p.value.message_dict) == ["artifact"] and "bfloat16" in str(on_310p.value)
    with pytest.raises(ValidationError) as wrong_dtype:
        spec = EndpointSpec(name="e2", artifact=artifact.pk, node="a2", devices=[0], dtype="float16")
        endpoint_create(spec=spec, user=operator)
    assert list(wrong_dtype.value.message_dict) == ["dtype"]
    assert "float16" in str(wrong_dtype.value) and "bfloat16" in str(wrong_dtype.value)
    assert not Endpoint.objects.exists()
    preview = endpoint_preview(
        spec=EndpointSpec(name="e3", artifact=artifact.pk, node="a2", devices=[0]), user=operator
    )
    assert preview["nodes"][0]["argv"] and not Endpoint.objects.exists()
