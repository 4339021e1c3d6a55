"""Build a model runtime from one frozen config: model (quantized), KV page spec, fingerprint.

Shared by prefill_svc and decode_svc (and the in-process reference the services are checked
against), so both ends load and quantize a model the same way and agree on the page format.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvwire.config import DType, KVDtype, ModelConfig, QuantMode
from kvwire.fingerprint import Fingerprint, fingerprint
from kvwire.kv.spec import KVPageSpec
from kvwire.malloc import keep_freed_memory
from kvwire.model.loader import load_model
from kvwire.model.model import Transformer
from kvwire.model.quant import HEAD_QUANTIZED, load_quantizer


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    weights: QuantMode = QuantMode.NONE  # none = the checkpoint in fp32
    kv_dtype: KVDtype = KVDtype.FP8_E4M3
    block_size: int = 16
    num_pages: int = 512
    device: str = "cpu"


@dataclass(frozen=True)
class Runtime:
    cfg: EngineConfig
    model: Transformer
    model_config: ModelConfig
    spec: KVPageSpec
    fingerprint: Fingerprint

    def new_cache(self, num_pages: int | None = None):
        from kvwire.kv.paged import PagedKVCache
        return PagedKVCache(self.model_config, self.spec, num_pages or self.cfg.num_pages, device=self.cfg.device)


def load_engine(cfg: EngineConfig) -> Runtime:
    keep_freed_memory()  # a prompt's temporaries stay in the heap between forwards (kvwire/malloc.py)
    weights = QuantMode(cfg.weights)
    dtype = DType.BF16 if weights == QuantMode.BF16 else DType.FP32
    # int8/fp8: each Linear is quantized as the loader reads its pieces (never a fp32 model first);
    # the layers are bit-identical to quantize_model(load_model(...), ...).
    quantize = load_quantizer(weights, include_lm_head=weights in HEAD_QUANTIZED)
    loaded = load_model(cfg.model_dir, dtype=dtype, device=cfg.device, quantize=quantize)
    model = loaded.model
    if cfg.device == "cpu":
        from kvwire.model.fast_decode import FastDecode
        model.step_fn = FastDecode.build(model)  # None: no compiler or an unsupported layer/shape
    spec = KVPageSpec.for_model(loaded.config, cfg.block_size, cfg.kv_dtype)
    fp = fingerprint(cfg.model_dir, loaded.config, loaded.weights_sha256, weights.value, dtype.value)
    return Runtime(cfg, model, loaded.config, spec, fp)
