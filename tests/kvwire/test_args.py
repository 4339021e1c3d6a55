"""EngineArgs: the services' flags generated from one declaration, range checks, --config files,
LLM keywords (and their deprecated aliases), and docs/configuration.md kept in step."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvwire.args import sections as kargs
from kvwire.args import EngineArgs, make_parser, markdown, parse_args, service_flags
from kvwire.config import KVDtype, WeightsMode
from kvwire.sampling_params import SpeculativeMode

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("tokenizer_svc", "prefill_svc", "decode_svc")


def flags(service: str) -> set[str]:
    return {s for a in make_parser(service, env={})._actions for s in a.option_strings if s.startswith("--")}


def test_each_service_takes_its_sections_with_its_own_defaults():
    assert len(service_flags("decode_svc")) == 51 and len(service_flags("prefill_svc")) == 22
    assert len(service_flags("tokenizer_svc")) == 30  # its 27, --decode-routing(-load-factor) and the shared --log-level
    d, p, t = (parse_args(s, []) for s in ("decode_svc", "prefill_svc", "tokenizer_svc"))
    assert (d.serving.listen, p.serving.listen, t.serving.listen) == ("127.0.0.1:50052", "127.0.0.1:50053",
                                                                      "127.0.0.1:50051")
    assert (d.cache.num_pages, p.cache.num_pages) == (2048, 1024)
    assert (d.serving.grace_s, p.serving.grace_s, t.serving.grace_s) == (20.0, 20.0, 30.0)
    assert d.model.weights is WeightsMode.INT8 and d.cache.kv_dtype is KVDtype.FP8_E4M3
    assert d.speculative.draft_kv_dtype is KVDtype.BF16 and d.kv_source.local_prefill_when_idle
    assert "--prefill-tls-ca" in flags("decode_svc") and "--decode-tls-ca" in flags("tokenizer_svc")
    assert "--speculative" not in flags("prefill_svc") and "--weights" not in flags("tokenizer_svc")


def test_flags_parse_into_typed_sections():
    a = parse_args("decode_svc", ["--weights", "bf16", "--speculative", "ngram", "--num-pages", "7",
                                        "--no-readiness-follows-prefill", "--prefill-tls-ca", "ca.pem",
                                        "--draft-weights", "none", "--threads", "3", "--no-reflection"])
    assert a.model.weights is WeightsMode.BF16 and a.speculative.mode is SpeculativeMode.NGRAM
    assert a.cache.num_pages == 7 and a.runtime_config().num_pages == 7 and a.compute.threads == 3
    assert a.kv_source.readiness_follows_prefill is False and a.peer.tls_ca == "ca.pem"
    assert a.speculative.draft_weights is WeightsMode.NONE and a.serving.no_reflection


def test_flags_used_by_the_manifests_tools_and_benchmarks_exist():
    for service in SERVICES:
        manifest = (REPO / "deploy" / "k8s" / "base" / f"{service.split('_')[0]}.yaml").read_text()
        used = set(re.findall(r"^\s+- (--[a-z0-9-]+)=", manifest, re.M))
        assert used and used <= flags(service), used - flags(service)
    stack = (REPO / "tools" / "stack.py").read_text()
    used = set(re.findall(r'"(--[a-z0-9-]+)"', stack))
    assert used and used <= flags("decode_svc") | flags("prefill_svc") | flags("tokenizer_svc")


@pytest.mark.parametrize("argv, message", [
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be in [1, 16]"),
    (["--num-speculative-tokens", "17"], "--num-speculative-tokens must be in [1, 16]"),
    (["--ngram-min", "5", "--ngram-max", "4"], "--ngram-min and --ngram-max need 1 <= min <= max"),
    (["--kv-transfer-timeout-s", "0"], "--kv-transfer-timeout-s must be positive"),
    (["--prefill-health-interval-s", "-1"], "--prefill-health-interval-s must be positive"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--num-pages", "0"], "--num-pages must be at least 1"),
    (["--grace-s", "-1"], "--grace-s must not be negative"),
])
def test_range_checks_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args("decode_svc", argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_range_checks_are_value_errors_for_llm():
    with pytest.raises(ValueError, match=r"--num-speculative-tokens must be in \[1, 16\]"):
        EngineArgs.from_llm_kwargs("m", num_speculative_tokens=17)
    with pytest.raises(ValueError, match="--ngram-min"):
        EngineArgs.from_llm_kwargs("m", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="not a valid WeightsMode"):
        EngineArgs.from_llm_kwargs("m", weights="int3")
    with pytest.raises(TypeError, match="unknown argument: listen"):  # a serving flag is not an LLM keyword
        EngineArgs.from_llm_kwargs("m", listen="x")


@pytest.mark.parametrize("service", ["prefill_svc", "decode_svc"])
def test_weights_gguf_is_served(service):
    assert parse_args(service, ["--weights", "gguf"]).model.weights is WeightsMode.GGUF
    assert EngineArgs.from_llm_kwargs("m", weights="gguf").model.weights is WeightsMode.GGUF
    assert parse_args(service, ["--weights", "int4"]).model.weights is WeightsMode.INT4
    assert parse_args(service, ["--weights", "int4-awq"]).model.weights is WeightsMode.INT4_AWQ


def test_llm_keywords_keep_their_defaults_and_deprecated_aliases():
    a = EngineArgs.from_llm_kwargs("m")
    assert (a.cache.num_pages, a.scheduler.max_waiting, a.scheduler.max_running) == (512, 1024, 16)
    assert a.model.model_dir == Path("m") and a.model.weights is WeightsMode.INT8
    with pytest.warns(DeprecationWarning, match="draft_model"):
        b = EngineArgs.from_llm_kwargs("m", draft_model=Path("d"), speculative_adaptive=False, speculative="draft")
    assert b.speculative.draft_model_dir == "d" and b.speculative.adaptive_speculation is False
    assert b.speculative.mode is SpeculativeMode.DRAFT


def test_variables_are_the_security_flags_defaults(monkeypatch):
    monkeypatch.setenv("KVWIRE_DRAIN_DELAY_S", "1.5")
    monkeypatch.setenv("KVWIRE_NO_REFLECTION", "yes")
    monkeypatch.setenv("KVWIRE_PREFILL_TOKEN_FILE", "/t")
    monkeypatch.setenv("KVWIRE_TLS_CERT", "/c")
    a = parse_args("decode_svc", ["--tls-cert", "/flag"])
    assert a.serving.drain_delay_s == 1.5 and a.serving.no_reflection and a.peer.token_file == "/t"
    assert a.security.tls_cert == "/flag"  # the flag wins
    monkeypatch.delenv("KVWIRE_NO_REFLECTION")
    assert not parse_args("decode_svc", []).serving.no_reflection


def write(tmp_path: Path, text: str) -> str:
    (tmp_path / "kvwire.toml").write_text(text)
    return str(tmp_path / "kvwire.toml")


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    cfg = write(tmp_path, 'num-pages = 99\nweights = "bf16"\nprefix_caching = true\n'
                          '[speculative]\nspeculative = "ngram"\nnum-speculative-tokens = 6\n'
                          '[serving]\ngrace-s = 3\n')
    a = parse_args("decode_svc", ["--config", cfg, "--weights", "fp8"])
    assert a.cache.num_pages == 99 and a.cache.prefix_caching and a.model.weights is WeightsMode.FP8
    assert a.speculative.mode is SpeculativeMode.NGRAM and a.speculative.num_speculative_tokens == 6
    assert a.serving.grace_s == 3.0
    assert parse_args("decode_svc", ["--config", cfg, "--no-prefix-caching"]).cache.prefix_caching is False


@pytest.mark.parametrize("text, message", [
    ("num-pagez = 3\n", "unknown key 'num-pagez'"),
    ("[speculative]\nweird = 1\n", "unknown key 'weird'"),
    ('speculative = "ngram"\n', "unknown key 'speculative'"),  # not a prefill_svc flag
    ('weights = "int3"\n', "choose from"),
    ('num-pages = "many"\n', "expected int"),
    ("prefix-caching = 1\n", "expected true or false"),
    ("num-pages = [", "--config"),
])
def test_config_file_errors_name_the_key(tmp_path, text, message, capsys):
    with pytest.raises(SystemExit):
        parse_args("prefill_svc", ["--config", write(tmp_path, text)])
    assert message in capsys.readouterr().err


def test_config_file_values_are_range_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args("decode_svc", ["--config", write(tmp_path, "ngram-min = 20\n")])
    assert "--ngram-min and --ngram-max" in capsys.readouterr().err


def test_mirrored_defaults_match_their_owners():
    from decode_svc.remote_prefill import DEFAULT_TRANSFER_TIMEOUT_S
    from kvwire.engine.scheduler import SchedulerConfig
    from kvwire.spec import SpecConfig
    from tokenizer_svc import routing, server

    assert (kargs.ROUTING_LOAD_FACTOR, routing.RoutingConfig.policy) == (routing.RoutingConfig.load_factor, "round_robin")
    assert tuple(m.value for m in kargs.DecodeRouting) == routing.POLICIES
    assert kargs.DEFAULT_TRANSFER_TIMEOUT_S == DEFAULT_TRANSFER_TIMEOUT_S
    assert (kargs.MAX_NUM_BATCHED_TOKENS, kargs.PREFILL_CHUNK, 1024) == (
        SchedulerConfig.max_num_batched_tokens, SchedulerConfig.prefill_chunk, SchedulerConfig.max_waiting)
    assert (kargs.SPEC_NGRAM_MAX, kargs.SPEC_GREEDY_MAX_BATCH) == (SpecConfig.ngram_max, SpecConfig.greedy_max_batch)
    assert (kargs.FRONT_DOOR_MESSAGE_BYTES, kargs.MAX_PROMPT_BYTES, kargs.MAX_PROMPT_TOKENS, kargs.TOKENIZE_WORKERS) == (
        server.DEFAULT_FRONT_DOOR_MESSAGE_BYTES, server.DEFAULT_MAX_PROMPT_BYTES, server.DEFAULT_MAX_PROMPT_TOKENS,
        server.DEFAULT_TOKENIZE_WORKERS)


def test_deprecated_names_still_work():
    from kvwire.config import QuantMode, RuntimeConfig
    from kvwire.runtime import EngineConfig, load_engine, load_runtime

    assert QuantMode is WeightsMode and QuantMode("int8") is WeightsMode.INT8
    assert EngineConfig is RuntimeConfig and load_engine is load_runtime


def test_configuration_doc_is_generated_and_current():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc == markdown(), "stale: run python -m kvwire.args --markdown > docs/configuration.md"
    for service in SERVICES:
        assert f"## {service}" in doc
    assert "`--num-speculative-tokens`" in doc and "`KVWIRE_DRAIN_DELAY_S`" in doc
