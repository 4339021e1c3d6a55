"""Any model starts: real service processes on model directories that are incomplete or broken.

prefill_svc and decode_svc need no tokenizer files (EOS ids come from config.json), decode_svc loads
a draft only when asked, and a missing or bad file is one line on stderr naming it, exit code 1,
never a traceback.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.generate import generate
from kvwire.model import registry
from kvwire.model.source import eos_token_ids
from kvwire.runtime import EngineConfig, load_engine
from kvwire.sampling_params import SamplingParams
from kvwire.tokenizer import ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.integration.test_stack import stream_text
from tools.stack import REPO, Stack, free_port

REAL = "smollm2-135m-instruct"

def bare_model(dst: Path) -> Path:
    """The embedded model's config.json and weights only: no tokenizer files, no generation_config."""
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(DEFAULT_MODEL_DIR / name, dst / name)
    return dst


def test_services_start_and_serve_without_tokenizer_files(tmp_path):
    """Only config.json + weights; config.json's eos_token_id is set to a token the model will emit,
    so stopping there shows decode_svc took its EOS from config.json."""
    tok = ModelTokenizer(DEFAULT_MODEL_DIR)
    engine = load_engine(EngineConfig(model_dir=DEFAULT_MODEL_DIR))
    prompt = tok.encode("The for statement")
    free = generate(engine.model, prompt, SamplingParams(max_tokens=16), eos_ids=tok.eos_ids,
                    cache=engine.new_cache(64))
    stop_at = next(i for i in range(3, len(free)) if free[i] not in free[:i])
    model = bare_model(tmp_path / "bare")
    cfg = json.loads((model / "config.json").read_text())
    cfg["eos_token_id"] = free[stop_at]
    (model / "config.json").write_text(json.dumps(cfg))
    assert eos_token_ids(model) == {free[stop_at]}  # from config.json alone
    logs = tmp_path / "logs"
    logs.mkdir()
    stack = Stack(model_dir=model, decode_pages=256, prefill_pages=256, log_dir=logs,
                  extra={"tokenizer_svc": ["--model-dir", str(DEFAULT_MODEL_DIR)]})  # the front door tokenizes
    with stack:
        _, ids, last = asyncio.run(stream_text(stack.addr("tokenizer_svc"), pb.GenerateTextRequest(
            text="The for statement", sampling=pb.SamplingParams(max_tokens=16))))
    assert ids == free[:stop_at + 1] and last.finish_reason == pb.FINISH_REASON_STOP
    decode_log = (logs / "decode_svc.log").read_text()
    assert "no draft model" in decode_log and "loaded (weights" not in decode_log  # not asked for, not loaded


def run_service(module: str, *flags: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, "--listen", f"127.0.0.1:{free_port()}", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(out: subprocess.CompletedProcess, module: str, *expected: str) -> None:
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{module}: "), last
    for part in expected:
        assert part in last, (part, last)


def broken(tmp_path: Path, kind: str) -> tuple[Path, tuple[str, ...]]:
    """A model path broken in one way, and what its error line must name."""
    if kind == "missing-dir":
        return tmp_path / "nowhere", ("nowhere", "no such file or directory")
    d = bare_model(tmp_path / kind)
    if kind == "garbage-config":
        (d / "config.json").write_text("{not json")
        return d, (str(d / "config.json"), "not valid JSON")
    if kind == "missing-weights":
        (d / "model.safetensors").unlink()
        return d, (str(d), "missing model.safetensors")
    if kind == "garbage-weights":
        (d / "model.safetensors").write_bytes(b"\x00" * 64)
        return d, (str(d / "model.safetensors"), "not a readable safetensors file")
    if kind == "garbage-gguf":
        g = tmp_path / "model.gguf"
        g.write_bytes(b"GGUF" + b"\xff" * 60)
        return g, (str(g), "not a readable GGUF file")
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["garbage-config", "missing-weights", "garbage-weights", "garbage-gguf",
                                  "missing-dir"])
def test_bad_model_files_are_one_line_naming_the_file(tmp_path, kind):
    path, expected = broken(tmp_path, kind)
    module = "decode_svc" if kind in ("garbage-config", "garbage-gguf") else "prefill_svc"
    assert_one_line_error(run_service(module, "--model-dir", str(path)), module, *expected)


def test_tokenizer_service_without_tokenizer_is_one_line(tmp_path):
    d = bare_model(tmp_path / "bare")
    assert_one_line_error(run_service("tokenizer_svc", "--model-dir", str(d)), "tokenizer_svc",
                          str(d), "missing tokenizer.json")


def test_mismatching_draft_is_one_line_naming_both(tmp_path):
    torch.manual_seed(0)
    other = tmp_path / "other-vocab"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(other)
    out = run_service("decode_svc", "--model-dir", str(DEFAULT_MODEL_DIR), "--draft-model-dir", str(other),
                      "--num-pages", "64")
    assert_one_line_error(out, "decode_svc", str(other), str(DEFAULT_MODEL_DIR), "vocab size 128", "4096")


def test_speculative_draft_without_a_draft_is_one_line(tmp_path):
    model = bare_model(tmp_path / "bare")  # no bare-draft beside it
    out = run_service("decode_svc", "--model-dir", str(model), "--speculative", "draft", "--num-pages", "64")
    assert_one_line_error(out, "decode_svc", "--draft-model-dir", str(tmp_path / "bare-draft"))


def test_bad_config_values_are_one_line(tmp_path):
    d = bare_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_attention_heads"] = 0
    (d / "config.json").write_text(json.dumps(cfg))
    out = run_service("prefill_svc", "--model-dir", str(d), "--num-pages", "64")
    assert_one_line_error(out, "prefill_svc", str(d / "config.json"), "num_attention_heads")


@pytest.mark.real_model
@pytest.mark.skipif(not registry.is_cached(REAL), reason=f"{REAL} is not fetched (python -m tools.fetch_model {REAL})")
def test_real_model_by_name_answers_through_the_services(tmp_path):
    """What tools/demo.sh runs: the fetched GGUF by its registered name, bf16 weights, FP8 KV, chat."""
    with Stack(model_dir=Path(REAL), weights="bf16", decode_pages=128, prefill_pages=128, log_dir=tmp_path) as s:
        text, ids, last = asyncio.run(stream_text(s.addr("tokenizer_svc"), pb.GenerateTextRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")]),
            sampling=pb.SamplingParams(max_tokens=30))))
    assert "Paris" in text and last.finish_reason == pb.FINISH_REASON_STOP, text
