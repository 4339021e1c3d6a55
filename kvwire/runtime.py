"""``load_runtime``: one frozen ``RuntimeConfig`` in, a ``Runtime`` out: model (quantized), KV page spec, fingerprint.

Shared by prefill_svc and decode_svc (and the in-process reference the services are checked
against), so both ends load and quantize a model the same way and agree on the page format.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvwire.config import DType, ModelConfig, RuntimeConfig, WeightsMode
from kvwire.fingerprint import Fingerprint, fingerprint
from kvwire.kv.paged import PagedKVCache
from kvwire.kv.spec import KVPageSpec
from kvwire.malloc import keep_freed_memory
from kvwire.model.fast_decode import FastDecode
from kvwire.model.loader import load_model
from kvwire.model.model import Transformer
from kvwire.model import awq, gptq
from kvwire.model.quant import HEAD_QUANTIZED, load_quantizer, quantize_model


EngineConfig = RuntimeConfig  # deprecated name of kvwire.config.RuntimeConfig

# Loaded as float first: their calibration runs the float model.
CALIBRATED = frozenset({WeightsMode.INT4_AWQ, WeightsMode.INT4_GPTQ})


@dataclass(frozen=True)
class Runtime:
    """A loaded model with its KV page spec and fingerprint (what prefill and decode agree on)."""

    cfg: RuntimeConfig
    model: Transformer
    model_config: ModelConfig
    spec: KVPageSpec
    fingerprint: Fingerprint
    # The checkpoint's own hash; the fingerprint's differs where the load changed the weights (int4-awq's scales).
    checkpoint_sha256: str = ""

    def new_cache(self, num_pages: int | None = None):
        return PagedKVCache(self.model_config, self.spec, num_pages or self.cfg.num_pages, device=self.cfg.device)


def load_runtime(cfg: RuntimeConfig) -> Runtime:
    keep_freed_memory()  # a prompt's temporaries stay in the heap between forwards (kvwire/malloc.py)
    weights = WeightsMode(cfg.weights)
    dtype = DType.BF16 if weights == WeightsMode.BF16 else DType.FP32
    # int8/fp8: each Linear is quantized as the loader reads its pieces (never a fp32 model first);
    # the layers are bit-identical to quantize_model(load_model(...), ...).
    quantize = load_quantizer(weights, include_lm_head=weights in HEAD_QUANTIZED)
    # gguf: a GGUF file's layers of the native block types keep their blocks; every other layer is int8.
    loaded = load_model(cfg.model_dir, dtype=dtype, device=cfg.device,
                        quantize=None if weights in CALIBRATED else quantize,
                        gguf_blocks=weights == WeightsMode.GGUF)
    model, weights_sha256 = loaded.model, loaded.weights_sha256
    if weights == WeightsMode.INT4_AWQ:
        # The float model first: its activations on calibration text choose the scales folded in,
        # then every block Linear is rounded to int4 blocks, each group's range searched (kvwire.model.awq).
        found = awq.calibrate_model(model, loaded.config, cfg.model_dir, loaded.weights_sha256)
        awq.quantize_blocks(model, found)
        quantize_model(model, weights, include_lm_head=True)  # lm_head, and any shape the blocks do not take
        # The scales are part of the weights run: peers whose searches differed refuse each other's KV.
        weights_sha256 = awq.scales_sha256(loaded.weights_sha256, found)
    elif weights == WeightsMode.INT4_GPTQ:
        # The same scales, then each block Linear rounded with error feedback, block by block (kvwire.model.gptq);
        # the fingerprint names the blocks' bytes.
        weights_sha256 = gptq.calibrate_model(model, loaded.config, cfg.model_dir, loaded.weights_sha256)
        quantize_model(model, weights, include_lm_head=True)
    if cfg.device == "cpu":
        model.step_fn = FastDecode.build(model)  # None: no compiler or an unsupported layer/shape
    spec = KVPageSpec.for_model(loaded.config, cfg.block_size, cfg.kv_dtype)
    fp = fingerprint(cfg.model_dir, loaded.config, weights_sha256, weights.value, dtype.value)
    return Runtime(cfg, model, loaded.config, spec, fp, loaded.weights_sha256)


load_engine = load_runtime  # deprecated name of load_runtime
