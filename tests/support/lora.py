"""LoRA adapters for tests: a PEFT-layout directory written by hand (any shapes, fast, no peft needed) for the
registry and launch tests, and a real one trained with peft on the demo model for the end-to-end test."""

import json
from pathlib import Path

#: (in, out) of each module of tests.support.tiny_models' default tiny Llama (hidden 64, 4 heads of 16, 2 KV heads,
#: intermediate 128).
TINY_DIMS = {
    "q_proj": (64, 64),
    "k_proj": (64, 32),
    "v_proj": (64, 32),
    "o_proj": (64, 64),
    "gate_proj": (64, 128),
    "up_proj": (64, 128),
    "down_proj": (128, 64),
}
_PARENT = dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), "self_attn") | dict.fromkeys(
    ("gate_proj", "up_proj", "down_proj"), "mlp"
)


def build_tiny_lora(
    directory,
    *,
    r: int = 8,
    layers: int = 2,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    dims: dict | None = None,
    architecture: str | None = "LlamaForCausalLM",
    weights: bool = True,
    **config,
) -> Path:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors, float32) for the tiny Llama; `dims`
    overrides a module's (in, out), `config` adapter_config.json's keys."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dims = {**TINY_DIMS, **(dims or {})}
    body = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": list(modules),
        "base_model_name_or_path": "tiny",
        "bias": "none",
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
    }
    if architecture:
        body["auto_mapping"] = {"base_model_class": architecture, "parent_library": "transformers"}
    body.update(config)
    (directory / "adapter_config.json").write_text(json.dumps(body))
    if weights:
        tensors = {}
        generator = torch.Generator().manual_seed(0)
        for layer in range(layers):
            for module in modules:
                width_in, width_out = dims[module]
                prefix = f"base_model.model.model.layers.{layer}.{_PARENT.get(module, 'mlp')}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, width_in, generator=generator) * 0.01
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(width_out, r, generator=generator) * 0.01
        save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    return directory
