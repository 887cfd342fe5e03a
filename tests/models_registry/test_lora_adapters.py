"""LoRA adapters in the registry: inspection of a PEFT directory, registration against the model's checkpoints
(architecture, layers, each module's widths), the API's 400s naming the field, confinement and audit."""

import json

import pytest

from console.models import AuditEvent
from models_registry.lora import LoraError, base_mismatch, inspect_lora_dir
from models_registry.models import Artifact
from tests.support.lora import build_tiny_lora


def test_inspection_reads_rank_alpha_modules_and_shapes(tmp_path):
    path = build_tiny_lora(tmp_path / "a", r=4, modules=("q_proj", "v_proj", "down_proj"), lora_alpha=8)
    info = inspect_lora_dir(path)
    assert (info["format"], info["r"], info["rank"], info["lora_alpha"]) == ("lora", 4, 4, 8)
    assert info["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert info["modules"]["q_proj"] == {"in": 64, "out": 64, "rank": 4}
    assert info["modules"]["v_proj"] == {"in": 64, "out": 32, "rank": 4}
    assert info["modules"]["down_proj"] == {"in": 128, "out": 64, "rank": 4}
    assert info["layers"] == 2 and info["base_architecture"] == "LlamaForCausalLM"
    assert info["base_model_name_or_path"] == "tiny" and info["dtype"] == "float32"
    assert info["files"] == ["adapter_config.json", "adapter_model.safetensors"]


def test_rank_pattern_raises_the_rank_vllm_checks(tmp_path):
    info = inspect_lora_dir(build_tiny_lora(tmp_path / "a", r=8, rank_pattern={"q_proj": 32}))
    assert info["r"] == 8 and info["rank"] == 32


@pytest.mark.parametrize(
    "config, message",
    [
        ({"peft_type": "IA3"}, "peft_type is 'IA3', not LORA"),
        ({"r": 0}, "r must be a positive integer"),
        ({"use_dora": True}, "vLLM cannot serve this adapter: DoRA (use_dora)"),
        ({"bias": "all"}, "bias 'all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']"),
    ],
)
def test_inspection_refuses_what_vllm_cannot_load(tmp_path, config, message):
    with pytest.raises(LoraError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        inspect_lora_dir(build_tiny_lora(tmp_path / "a", **config))


def test_inspection_refuses_a_model_dir_and_bin_weights(tmp_path):
    with pytest.raises(LoraError, match="no adapter_config.json"):
        inspect_lora_dir(tmp_path)
    path = build_tiny_lora(tmp_path / "a", weights=False)
    (path / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(LoraError, match="adapter_model.bin is there: save it with safe_serialization"):
        inspect_lora_dir(path)


def test_base_mismatch_names_module_widths_and_both_sides(tmp_path):
    base = {"architecture": "LlamaForCausalLM", "num_layers": 2, "hidden_size": 64, "intermediate_size": 128}
    base |= {"num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    good = inspect_lora_dir(
        build_tiny_lora(
            tmp_path / "good",
            modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        )
    )
    assert base_mismatch(good, base, adapter_name="A", base_name="B") == ""
    wide = inspect_lora_dir(build_tiny_lora(tmp_path / "wide", modules=("q_proj",), dims={"q_proj": (576, 576)}))
    why = base_mismatch(wide, base, adapter_name="Adapter 'x'", base_name="tiny (artifact #1)")
    assert why.startswith("Adapter 'x''s q_proj maps 576 → 576") and "tiny (artifact #1)'s q_proj maps 64 → 64" in why
    qwen = inspect_lora_dir(build_tiny_lora(tmp_path / "qwen", architecture="Qwen2ForCausalLM"))
    assert "made for a Qwen2ForCausalLM base" in base_mismatch(qwen, base, adapter_name="A", base_name="B")
    deep = inspect_lora_dir(build_tiny_lora(tmp_path / "deep", layers=3))
    assert base_mismatch(deep, base, adapter_name="A", base_name="B") == "A adapts 3 layers, but B has 2."


@pytest.mark.django_db
def test_register_adapter_through_the_api(operator, api_for, tiny_artifact, model_root, redis_conn):
    api = api_for(operator)
    path = build_tiny_lora(model_root / "tiny-lora", r=8)
    response = api.post(f"/api/v1/models/{tiny_artifact.model_id}/adapters", {"name": "tiny-sql", "path": str(path)})
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["format"], body["name"], body["model"], body["servable"]) == (
        "lora",
        "tiny-sql",
        tiny_artifact.model_id,
        False,
    )
    assert body["inspection"]["rank"] == 8 and body["params"] == {"checked_against": [tiny_artifact.pk]}
    assert [a["id"] for a in api.get(f"/api/v1/models/{tiny_artifact.model_id}/adapters").json()] == [body["id"]]
    event = AuditEvent.objects.get(action="adapter.register")
    assert event.actor == operator and event.changes == {
        "model": tiny_artifact.model_id,
        "name": "tiny-sql",
        "path": str(path),
        "rank": 8,
    }
    again = api.post(f"/api/v1/models/{tiny_artifact.model_id}/adapters", {"name": "tiny-sql", "path": str(path)})
    assert again.status_code == 400 and "exists already" in json.dumps(again.json())


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field, text",
    [
        ({"name": "", "path": "{lora}"}, "name", "Enter the adapter's name"),
        ({"name": "has space", "path": "{lora}"}, "name", "Use letters, digits"),
        ({"name": "x", "path": "/etc"}, "path", "outside the allowed model roots"),
        ({"name": "x", "path": "{root}/missing"}, "path", "does not exist"),
        ({"name": "x", "path": "{root}/tiny"}, "path", "no adapter_config.json"),
        ({"name": "x", "path": "{wide}"}, "path", "q_proj maps 576 → 576"),
    ],
)
def test_bad_adapters_get_a_400_naming_the_field(operator, api_for, tiny_artifact, model_root, body, field, text):
    lora = build_tiny_lora(model_root / "lora")
    wide = build_tiny_lora(model_root / "wide", modules=("q_proj",), dims={"q_proj": (576, 576)})
    body = {k: v.format(lora=lora, root=model_root, wide=wide) for k, v in body.items()}
    response = api_for(operator).post(f"/api/v1/models/{tiny_artifact.model_id}/adapters", body)
    assert response.status_code == 400, response.content
    answer = json.dumps(response.json(), ensure_ascii=False)
    assert field in answer and text in answer, answer
    assert not Artifact.objects.filter(format="lora").exists()


@pytest.mark.django_db
def test_mismatch_names_the_adapter_and_the_base(operator, api_for, tiny_artifact, model_root):
    wide = build_tiny_lora(model_root / "wide", modules=("down_proj",), dims={"down_proj": (1536, 576)})
    response = api_for(operator).post(
        f"/api/v1/models/{tiny_artifact.model_id}/adapters", {"name": "w", "path": str(wide)}
    )
    message = json.dumps(response.json(), ensure_ascii=False)
    assert (
        f"Adapter 'w' ({wide})" in message and f"tiny (artifact #{tiny_artifact.pk}, {tiny_artifact.path})" in message
    )
    assert "down_proj maps 1536 → 576" in message and "maps 128 → 64" in message


@pytest.mark.django_db
def test_viewer_cannot_register_an_adapter(viewer, api_for, tiny_artifact, model_root):
    path = build_tiny_lora(model_root / "lora")
    response = api_for(viewer).post(
        f"/api/v1/models/{tiny_artifact.model_id}/adapters", {"name": "x", "path": str(path)}
    )
    assert response.status_code == 403


@pytest.mark.django_db
def test_model_and_adapter_pages_show_an_adapter(as_viewer, tiny_artifact, model_root):
    path = build_tiny_lora(model_root / "lora")
    adapter = Artifact.objects.create(
        model=tiny_artifact.model, name="sql", format="lora", path=str(path), inspection=inspect_lora_dir(path)
    )
    assert as_viewer.get(f"/models/{tiny_artifact.model_id}/").status_code == 200
    page = as_viewer.get(adapter.get_absolute_url())
    assert page.status_code == 200 and "LoRA adapter" in page.content.decode()
