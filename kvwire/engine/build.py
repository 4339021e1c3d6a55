"""``build_engine(args)``: the one way an ``EngineArgs`` becomes an ``EngineCore`` (``LLM`` and decode_svc).

Loads the target runtime, the draft model or draft head (with the vocabulary and tokenizer checks),
the ModelRunner, the scheduler and speculative configs and the EOS ids. Every torch call of a
service happens on its compute thread, so decode_svc runs this whole function there.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path

from kvwire.args import EngineArgs, SpeculativeArgs
from kvwire.config import RuntimeConfig
from kvwire.engine.core import EngineCore
from kvwire.engine.runner import ModelRunner
from kvwire.engine.scheduler import SchedulerConfig
from kvwire.files import LoadError
from kvwire.grammar import Grammars
from kvwire.model import gguf
from kvwire.model.draft_head import is_draft_head, load_for_target, shipped_head
from kvwire.model.source import eos_token_ids, load_config
from kvwire.runtime import Runtime, load_runtime
from kvwire.sampling_params import SpeculativeMode
from kvwire.spec import SpecConfig, attach_draft

log = logging.getLogger("kvwire.engine")


def build_engine(args: EngineArgs, *, warm_up: bool = False, extra_eos: Iterable[int] = ()) -> EngineCore:
    """The engine ``args`` describe (its runner: ``core.runner``; the target: ``core.runner.runtime``).
    ``warm_up``: run the runner's warm-up and drop GGUF readers (a service about to serve);
    ``extra_eos``: ids that end a sequence too (LLM: its tokenizer's). LoadError for a model or draft
    that cannot be loaded or does not fit the target."""
    runtime = load_runtime(args.runtime_config())
    eos = set(eos_token_ids(args.model.model_dir, runtime.model_config)) | set(extra_eos)  # no tokenizer.json needed
    draft = load_draft(args, runtime)
    runner = ModelRunner(runtime, args.cache.num_pages, prefix_caching=args.cache.prefix_caching)
    drafter = attach_draft(runner, draft)  # before warm_up: the draft's paths are warmed up with the runner's
    if warm_up:
        runner.warm_up()
        gguf.forget_readers()  # everything read from a GGUF model file is loaded by now
    grammars = Grammars(args.model.model_dir, runtime.model_config.vocab_size, eos)  # its tokenizer read on first use
    return EngineCore(runner, scheduler_config(args), spec_config(args.speculative), eos, draft=drafter,
                      grammars=grammars)


def scheduler_config(args: EngineArgs) -> SchedulerConfig:
    s = args.scheduler
    return SchedulerConfig(total_pages=args.cache.num_pages, max_running=s.max_running, max_waiting=s.max_waiting,
                           max_num_batched_tokens=s.max_num_batched_tokens,
                           prefill_chunk=s.prefill_chunk_size if s.chunked_prefill else None,
                           max_prefill_stall=s.max_prefill_stall or None)


def spec_config(s: SpeculativeArgs) -> SpecConfig:
    return SpecConfig(mode=s.mode, num_tokens=s.num_speculative_tokens, adaptive=s.adaptive_speculation,
                      ngram_max=s.ngram_max, ngram_min=s.ngram_min, auto_off=s.speculative_auto_off,
                      greedy_max_batch=s.speculative_greedy_max_batch)


def draft_path(model_dir: str | Path, mode: SpeculativeMode | str, draft_model_dir: str | None) -> Path | None:
    """The draft asked for: --draft-model-dir when given ('' = none); with --speculative draft and no
    --draft-model-dir, the ``<model-dir>-draft`` directory beside the model (the embedded pair)."""
    if draft_model_dir is not None:
        return Path(draft_model_dir) if draft_model_dir else None
    if SpeculativeMode(mode) is not SpeculativeMode.DRAFT:
        return None
    sibling = Path(model_dir).parent / f"{Path(model_dir).name}-draft"
    if not sibling.is_dir() and shipped_head(model_dir) is not None:
        return shipped_head(model_dir)  # a registered model's draft head, from models/
    if not sibling.is_dir():
        raise LoadError(f"--speculative draft needs a draft model: pass --draft-model-dir (there is no "
                        f"{sibling} beside {model_dir})")
    return sibling


def load_draft(args: EngineArgs, target: Runtime):
    """The draft model (or draft head) when one is asked for, else None (speculative=draft requests
    are then refused). A draft that does not share the target's vocabulary, or a head distilled
    from other weights, is a LoadError naming both."""
    s = args.speculative
    path = draft_path(args.model.model_dir, s.mode, s.draft_model_dir)
    if path is None:
        log.info("no draft model: speculative=draft requests will be refused")
        return None
    weights = s.draft_weights or args.model.weights  # quantized as the target unless told otherwise
    if is_draft_head(path):
        head = load_for_target(path, target, weights)
        log.info("draft head %s loaded (weights %s; %d-token head vocabulary)", path, weights.value,
                 head.cfg.head_vocab)
        return head
    draft_config = load_config(path)
    if draft_config.vocab_size != target.model_config.vocab_size:
        raise LoadError(f"draft model {path} has vocab size {draft_config.vocab_size}, the target "
                        f"{target.cfg.model_dir} has {target.model_config.vocab_size}: a draft must share "
                        "the target's tokenizer")
    cfg: RuntimeConfig = dataclasses.replace(target.cfg, model_dir=path, weights=weights, kv_dtype=s.draft_kv_dtype)
    draft = load_runtime(cfg)
    if draft.fingerprint.tokenizer_sha256 != target.fingerprint.tokenizer_sha256:
        raise LoadError(f"draft model {path} does not share the tokenizer of the target {target.cfg.model_dir} "
                        f"(tokenizer sha256 {draft.fingerprint.tokenizer_sha256[:12] or 'none'} vs "
                        f"{target.fingerprint.tokenizer_sha256[:12] or 'none'})")
    log.info("draft model %s loaded (weights %s, KV %s)", path, cfg.weights.value, cfg.kv_dtype.value)
    return draft
