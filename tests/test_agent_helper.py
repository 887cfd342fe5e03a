"""The slow tests' agent helper gives a new node the model information earlier nodes of the run made; a restarted
node keeps its own (tests/support/agents.py)."""

import json

from tests.support import agents


def _entry(folder, name: str) -> None:
    modelinfos = agents._modelinfos(folder)
    modelinfos.mkdir(parents=True, exist_ok=True)
    (modelinfos / name).write_text(json.dumps({"name": name}))


def test_a_new_node_gets_earlier_nodes_model_information_and_a_restart_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(agents, "_NODE_CACHES", [])
    env = {"DATA_DIR": str(tmp_path)}
    first, second = tmp_path / "engine-cache" / "node-a", tmp_path / "engine-cache" / "node-b"

    agents._give_model_information(env, "node-a")
    assert not first.exists()  # the run's first node starts empty
    _entry(first, "llama.json")

    agents._give_model_information(env, "node-b")
    _entry(second, "qwen.json")
    assert sorted(p.name for p in agents._modelinfos(second).iterdir()) == ["llama.json", "qwen.json"]

    agents._give_model_information(env, "node-b")  # the same node's agent restarted: its folder onto itself
    agents._give_model_information(env, "node-a")
    assert sorted(p.name for p in agents._modelinfos(first).iterdir()) == ["llama.json", "qwen.json"]
    assert agents._NODE_CACHES == [first, second]
