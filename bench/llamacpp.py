"""llama.cpp as a peer, through ``llama-cpp-python``: the same weights converted to GGUF locally.

    python -m bench engine --peers llama.cpp-f16,llama.cpp-q8_0
    python -m bench accuracy --model smollm2-135m-instruct     # perplexity rows

Method and details: bench/README.md, section ``bench/llamacpp.py``.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib
import json
from pathlib import Path

import numpy as np

from bench.common import MODELS
from bench.phases import prompts, time_phases
from kvwire.model import gguf as ours


def status() -> tuple[bool, str]:
    """(usable, why not)."""
    try:
        importlib.import_module("gguf")
        import llama_cpp
        return True, f"llama-cpp-python {llama_cpp.__version__}"
    except Exception as e:  # ImportError, or a library that fails to load
        return False, f"llama-cpp-python / gguf not importable ({e!r}); install with `pip install llama-cpp-python gguf`" \
                      " (compiles llama.cpp with cmake, about 20 min on 2 cores)"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _writer(cfg: dict, arch: str, name: str, path: Path):
    """A GGUFWriter with the hyperparameters of an HF-style config dict; no tokenizer
    (``no_vocab`` with the vocabulary size: the benchmarks feed token ids)."""
    import gguf
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, head_dim = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-5))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("no_vocab")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    return w


def _finish(w, tmp: Path, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    tmp.rename(out)
    return out


def to_gguf(model_dir: Path, out: Path) -> Path:
    """f16 GGUF of an HF Llama checkpoint (written once, to a temporary name first; reused while present)."""
    from safetensors import safe_open
    if out.is_file():
        return out
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    tmp = out.with_suffix(".tmp")
    w = _writer(cfg, "llama", model_dir.name, tmp)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name).float().numpy()
                if name.startswith("model.layers."):
                    i, rest = name.removeprefix("model.layers.").split(".", 1)
                    key = rest.removesuffix(".weight")
                    if key not in per_layer:
                        continue
                    if key == "self_attn.q_proj":
                        t = permute(t, heads)
                    elif key == "self_attn.k_proj":
                        t = permute(t, kv)
                    gname = f"blk.{i}.{per_layer[key]}.weight"
                elif name in names:
                    gname = names[name]
                else:
                    continue
                w.add_tensor(gname, t.astype(np.float16) if t.ndim == 2 else t.astype(np.float32))
    return _finish(w, tmp, out)


def gguf_to_f16(src: Path, out: Path) -> Path:
    """f16 GGUF of any GGUF checkpoint (e.g. a Q4_1 one): every matrix dequantized with the
    ``gguf`` package and stored as f16, vectors as f32. Tensors keep llama.cpp's names and row
    order (Q/K are already permuted in the source), so this is the same weights our loader reads."""
    from gguf.quants import dequantize

    if out.is_file():
        return out
    reader = ours.open_gguf(src)
    cfg = ours.hf_config(reader, str(src))
    arch = ours.field(reader, "general.architecture")
    tmp = out.with_suffix(".tmp")
    w = _writer(cfg, arch, src.stem, tmp)
    for t in reader.tensors:
        x = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        x = x.reshape(tuple(int(n) for n in reversed(t.shape)))  # [rows, cols]
        w.add_tensor(t.name, x.astype(np.float16) if x.ndim == 2 else x)
    return _finish(w, tmp, out)


def quantize_q8_0(f16: Path, out: Path, ftype: str = "LLAMA_FTYPE_MOSTLY_Q8_0") -> Path:
    """``f16`` quantized by llama.cpp's own quantizer (``ftype``: a ``LLAMA_FTYPE_*`` name) into ``out``."""
    import llama_cpp
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, ftype)
        params.nthread = 0
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama_model_quantize failed for {f16}")
    return out


def gguf_for(model_path: Path, fmt: str) -> Path:
    """The f16, q8_0, q4_k_m, q4_0 or q4_1 GGUF of a checkpoint (an HF directory, or a GGUF file / a directory holding
    one), cached under bench/.models/gguf (git-ignored; never beside a model in the repo) and keyed
    by the weights' path, size and mtime, so a rebuilt model converts anew. ``file``: a GGUF
    checkpoint itself, as shipped (its own tensor types)."""
    src = ours.find_gguf(Path(model_path))
    if fmt == "file":
        if src is None:
            raise ValueError(f"{model_path} is not a GGUF file: llama.cpp's 'file' row needs one")
        return src
    weights = [src.resolve()] if src is not None else sorted(Path(model_path).resolve().glob("*.safetensors"))
    key = hashlib.sha256("|".join(f"{w}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights).encode())
    out = MODELS / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{(src.stem if src is not None else Path(model_path).name)}-{key.hexdigest()[:12]}"
    f16 = out / f"{stem}-f16.gguf"
    f16 = gguf_to_f16(src, f16) if src is not None else to_gguf(Path(model_path), f16)
    if fmt in ("q4_k_m", "q4_0", "q4_1"):  # q4_k_m: what llama.cpp users mostly run; q4_0 / q4_1: its plain 4-bit
        return quantize_q8_0(f16, out / f"{stem}-{fmt}.gguf", f"LLAMA_FTYPE_MOSTLY_{fmt.upper()}")
    return f16 if fmt == "f16" else quantize_q8_0(f16, out / f"{stem}-q8_0.gguf")


def perplexity(path: Path, windows: list[list[int]], threads: int = 2, desc: str = "llama.cpp",
               reference: list | None = None, kl: list | None = None) -> float:
    """Perplexity of llama.cpp on ``windows`` (token ids): each window one batch in a fresh context,
    logits for every position (llama-cpp-python's ``logits_all``), the same scoring as bench/accuracy.
    With ``reference`` (per window, log-probs [len - 1, vocab] of another run) the mean KL divergence
    reference || llama.cpp per token, in nats, is appended to ``kl``."""
    import llama_cpp as L
    from tqdm import tqdm
    _quiet(L)
    n = max(len(w) for w in windows)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n, n, n, 1
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(n, 0, 1)
    nll, count, kl_sum, seen = 0.0, 0, 0.0, []
    try:
        for w in tqdm(windows, desc=desc, unit="window"):
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            batch.n_tokens = len(w)
            for i, tok in enumerate(w):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, True
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(w), n_vocab))[:-1]
            logits = logits.astype(np.float64)
            top = logits.max(axis=1, keepdims=True)
            logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))  # [len(w) - 1]
            nll += float((logz - logits[np.arange(len(w) - 1), w[1:]]).sum())
            if reference is not None:
                ref = np.asarray(reference[len(seen)], dtype=np.float64)
                kl_sum += float((np.exp(ref) * (ref - (logits - logz[:, None]))).sum())
            seen.append(len(w))
            count += len(w) - 1
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    if reference is not None and kl is not None:
        kl.append(kl_sum / count)
    return float(np.exp(nll / count))


def _quiet(L) -> None:
    try:
        from llama_cpp import _logger
        _logger.set_verbose(False)  # llama.cpp's load log is long; errors still print
    except ImportError:
        pass


def weight_bytes(path: Path) -> int:
    """Bytes a decode step reads: every matrix but the token embedding (unless it is the output too)."""
    import gguf
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def run_llamacpp(s: dict) -> dict:
    import llama_cpp as L
    _quiet(L)
    path = gguf_for(Path(s["model_dir"]), s["weights"])
    nmax = max(s["batches"])
    n_ctx = max(s["prompt_len"], nmax * s["batch_ctx"]) + nmax * (s["decode_tokens"] + 32)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = s.get("extra_bufts", True)  # llama.cpp's repacked weights (AMX, ...): its default
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, max(512, nmax * s["batch_ctx"]), 512, nmax
    cp.n_threads = cp.n_threads_batch = s["threads"]
    cp.kv_unified = True  # one KV buffer shared by the streams (each gets what it uses)
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    prompt, ctxs = prompts(s, n_vocab)
    batch = L.llama_batch_init(max(n_ctx, cp.n_batch), 0, nmax)
    state = {"pos": []}

    def submit(items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, position, sequence, wants logits); returns the argmax of each logits row."""
        batch.n_tokens = len(items)
        rows = []
        for i, (tok, pos, seq, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
            if want:
                rows.append(i)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, r), shape=(n_vocab,)).argmax()) for r in rows]

    def prefill(seqs: list[list[int]]) -> list[int]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        state["pos"] = [len(x) for x in seqs]
        return submit([(t, p, i, p == len(x) - 1) for i, x in enumerate(seqs) for p, t in enumerate(x)])

    def decode(tokens: list[int]) -> list[int]:
        out = submit([(t, state["pos"][i], i, True) for i, t in enumerate(tokens)])
        state["pos"] = [p + 1 for p in state["pos"][:len(tokens)]]
        return out

    try:
        res = time_phases(prefill, decode, prompt, ctxs, s)
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return {**res, "weight_bytes_per_token": weight_bytes(path), "gguf": str(path)}
