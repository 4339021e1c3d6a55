"""build_engine: one path from EngineArgs to an EngineCore, so LLM gets decode_svc's draft checks, and
the services report bad flags and --config keys as argparse errors before loading anything."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvwire import LLM
from kvwire.args import EngineArgs
from kvwire.config import KVDtype, WeightsMode
from kvwire.engine.build import build_engine
from kvwire.files import LoadError
from kvwire.sampling_params import SpeculativeMode
from tests.decode_svc.harness import tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("target"))


def test_llm_refuses_a_draft_with_another_vocabulary(target, tmp_path):
    other = tiny_model(tmp_path / "other", seed=1, vocab_size=256, hidden_size=32, num_layers=1)
    with pytest.raises(LoadError, match="has vocab size 256, the target .* has 300"):
        LLM(target, num_pages=16, draft_model_dir=other, speculative="draft")


def test_llm_finds_the_sibling_draft_as_decode_svc_does(tmp_path):
    model = tiny_model(tmp_path / "m")
    with pytest.raises(LoadError, match="--draft-model-dir"):  # --speculative draft, no draft anywhere
        LLM(model, num_pages=16, speculative="draft")
    tiny_model(tmp_path / "m-draft", seed=1, hidden_size=32, num_layers=1)
    llm = LLM(model, num_pages=16, speculative="draft")
    assert llm.core.draft.runtime.cfg.model_dir == tmp_path / "m-draft"


def test_build_engine_wires_every_section(target, tmp_path):
    draft = tiny_model(tmp_path / "d", seed=2, hidden_size=32, num_layers=1)
    args = EngineArgs.from_llm_kwargs(target, weights="none", num_pages=32, max_running=3, max_waiting=5,
                                      speculative="ngram", num_speculative_tokens=6, ngram_max=7, ngram_min=2,
                                      adaptive_speculation=False, draft_model_dir=str(draft), prefix_caching=True)
    core = build_engine(args)
    assert core.runner.runtime.cfg.weights is WeightsMode.NONE and core.runner.runtime.cfg.num_pages == 32
    assert core.draft.runtime.cfg.kv_dtype is KVDtype.BF16 and core.draft.runtime.cfg.weights is WeightsMode.NONE
    assert (core.spec_cfg.mode, core.spec_cfg.num_tokens, core.spec_cfg.adaptive) == (SpeculativeMode.NGRAM, 6, False)
    assert (core.spec_cfg.ngram_max, core.spec_cfg.ngram_min) == (7, 2)
    sched = core.scheduler.cfg
    assert (sched.total_pages, sched.max_running, sched.max_waiting) == (32, 3, 5)
    assert core.runner.prefix is not None  # prefix caching on


def test_llm_range_errors_come_before_loading():
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        LLM("/no/such/model", num_speculative_tokens=0)


@pytest.mark.parametrize("service, argv, expected", [
    ("decode_svc", ["--num-speculative-tokens", "0"], "--num-speculative-tokens must be in [1, 16]"),
    ("prefill_svc", ["--threads", "0"], "--threads must be at least 1"),
    ("tokenizer_svc", ["--config", "CONFIG"], "unknown key 'num-pages'"),  # a decode flag, not the front door's
])
def test_services_report_bad_flags_as_usage_errors(service, argv, expected, tmp_path):
    (tmp_path / "c.toml").write_text("num-pages = 8\n")
    argv = [str(tmp_path / "c.toml") if a == "CONFIG" else a for a in argv]
    out = subprocess.run([sys.executable, "-m", service, *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and expected in out.stderr, out.stderr[-2000:]
