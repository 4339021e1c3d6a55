"""PagedKVCache inside the real model, against DenseKVCache and HF transformers.

Tiny random checkpoints are written with save_pretrained and loaded with our loader. The Llama
one uses initializer_range=0.1 (HF's default 0.02 leaves attention almost uniform, which would
hide KV errors): its logits have a std of about 0.7.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from kvwire.config import KVDtype
from kvwire.kv.dense import DenseKVCache
from kvwire.kv.paged import MAX_PAGED_QUERIES, PagedKVCache
from kvwire.kv.pool import RELEASED, OutOfPages
from kvwire.kv.spec import KVPageSpec, ScaleDtype, ScaleGranularity
from kvwire.model.loader import load_model

VOCAB = 256


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1)).eval()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return load_model(path)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
        max_position_embeddings=512, initializer_range=0.1)).eval()
    path = tmp_path_factory.mktemp("mistral")
    hf.save_pretrained(path)
    return hf, load_model(path)


def paged(loaded, dtype=KVDtype.FP8_E4M3, block=16, num_pages=32):
    return PagedKVCache(loaded.config, KVPageSpec.for_model(loaded.config, block, dtype), num_pages)


def teacher_forced_logits(model, cache, ids, prompt_len):
    """Prefill ids[:prompt_len], then feed the rest one token at a time: [len(ids) - prompt_len + 1, vocab]."""
    out = [model(ids[:prompt_len], cache.prepare([0], [prompt_len]), cache)[-1:]]
    for i in range(prompt_len, len(ids)):
        out.append(model(ids[i:i + 1], cache.prepare([0], [1]), cache))
    return torch.cat(out)


@pytest.mark.parametrize("dtype,tol", [(KVDtype.BF16, 0.05), (KVDtype.FP8_E4M3, 0.4)],
                         ids=["bf16", "fp8"])
def test_logits_close_to_dense(llama, dtype, tol):
    # Measured max |dlogit| over 40 decode steps: bf16 0.014, fp8 0.17 (logit std 0.7). Prefill
    # attends over full-precision K/V, so its logits are exact.
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(1))
    expect = teacher_forced_logits(llama.model, DenseKVCache(llama.config, 1, 64), ids, 20)
    got = teacher_forced_logits(llama.model, paged(llama, dtype), ids, 20)
    torch.testing.assert_close(got[0], expect[0], rtol=0, atol=1e-5)
    assert (got - expect).abs().max().item() < tol
    assert (got.argmax(-1) == expect.argmax(-1)).float().mean().item() >= 0.9


def greedy(model, cache, prompts, steps, seq_ids):
    """Prefill all prompts in one step, then decode all sequences together."""
    lens = [len(p) for p in prompts]
    rows = torch.tensor(lens).cumsum(0) - 1
    logits = model(torch.tensor([t for p in prompts for t in p]), cache.prepare(seq_ids, lens),
                   cache, logits_rows=rows)
    out = [[int(x)] for x in logits.argmax(-1)]
    for _ in range(steps - 1):
        last = torch.tensor([o[-1] for o in out])
        logits = model(last, cache.prepare(seq_ids, [1] * len(seq_ids)), cache)
        for o, x in zip(out, logits.argmax(-1)):
            o.append(int(x))
    return out


def test_batched_decode_equals_each_alone(llama):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 33)]
    batched = greedy(llama.model, paged(llama), prompts, 24, seq_ids=[10, 11, 12])
    alone = [greedy(llama.model, paged(llama), [p], 24, seq_ids=[0])[0] for p in prompts]
    assert batched == alone


def test_mixed_step_prefill_decode_and_verify(llama):
    """One step holding a fresh prompt, a one-token decode and a 4-token verify run, then a
    rollback: each row's logits match a dense cache that saw the same tokens (bf16 pages)."""
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, VOCAB, (n,), generator=g) for n in (12, 9, 7))
    cache, dense = paged(llama, KVDtype.BF16), DenseKVCache(llama.config, 3, 64)
    m = llama.model
    for cc, seqs in ((cache, [0, 1]), (dense, [0, 1])):  # b and c: existing context
        m(torch.cat([b, c]), cc.prepare(seqs, [9, 7]), cc)
    toks = torch.cat([a, b[:1], c[:4]])  # a: fresh prompt; b: decode; c: verify 4 tokens
    got = m(toks, cache.prepare([2, 0, 1], [12, 1, 4]), cache)
    expect = m(toks, dense.prepare([2, 0, 1], [12, 1, 4]), dense)
    assert (got - expect).abs().max().item() < 0.05
    cache.truncate(1, 8)  # reject 3 of c's 4 draft tokens (8 = 7 + 1 accepted)
    dense.truncate(1, 8)
    got = m(c[4:5], cache.prepare([1], [1]), cache)
    expect = m(c[4:5], dense.prepare([1], [1]), dense)
    assert (got - expect).abs().max().item() < 0.05
    assert cache.length(1) == 9 and len(cache.page_ids(1)) == 1


def test_out_of_pages_changes_nothing(llama):
    cache = paged(llama, block=16, num_pages=3)
    m = llama.model
    m(torch.arange(20), cache.prepare([0], [20]), cache)  # 2 pages
    before = (cache.stats(), cache.page_ids(0), cache.length(0))
    assert cache.can_fit(28, seq_id=0) and not cache.can_fit(29, seq_id=0)  # 48 tokens = 3 pages
    with pytest.raises(OutOfPages):
        cache.prepare([0, 1], [1, 17])  # 0 + 2 pages > 1 free
    assert (cache.stats(), cache.page_ids(0), cache.length(0)) == before and 1 not in cache.tables
    m(torch.tensor([5]), cache.prepare([0], [1]), cache)  # still usable
    cache.free_sequence(0)
    assert cache.stats()["used"] == 0


def test_sliding_window_memory_flat_and_greedy_matches_transformers(mistral):
    hf, ours = mistral
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(4))
    steps = 60  # 70 positions, window 16
    with torch.no_grad():
        out = hf.generate(prompt[None], attention_mask=torch.ones(1, 10, dtype=torch.long),
                          max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    expect = out[0, 10:].tolist()

    cache = paged(ours, KVDtype.BF16, block=4, num_pages=8)  # 8 pages = 32 tokens < 70
    m = ours.model
    logits = m(prompt, cache.prepare([0], [10]), cache, logits_rows=torch.tensor([9]))
    tokens, used = [int(logits.argmax())], []
    for _ in range(steps - 1):
        logits = m(torch.tensor(tokens[-1:]), cache.prepare([0], [1]), cache)
        tokens.append(int(logits.argmax()))
        used.append(cache.stats()["used"])
    # A query sees 16 positions: at most 5 pages of 4, plus the one given back at the next step.
    assert max(used) <= 6 and used[-1] == used[-20]
    assert cache.page_ids(0)[0] == RELEASED and cache.length(0) == 69
    assert tokens == expect


# ---- format 2: append-only pages, one-call verification, exact rollback ---------------------------

def write_step(cache, seq_lens: dict[int, int], g: torch.Generator, scale: float = 1.0) -> None:
    """One step straight through the cache's own write + attend (random K/V, every layer)."""
    seqs = list(seq_lens)
    n = sum(seq_lens.values())
    cache.prepare(seqs, [seq_lens[s] for s in seqs])
    cfg = cache.cfg
    for layer in range(cfg.num_layers):
        k, v = (torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g) * scale for _ in range(2))
        q = torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g)
        assert cache.attend(layer, q, k, v, None).isfinite().all()


def cache_bytes(cache) -> list[torch.Tensor]:
    return [t.clone() for t in cache._tensors()]


@pytest.mark.parametrize("dtype", [KVDtype.FP8_E4M3, KVDtype.BF16], ids=["fp8", "bf16"])
def test_truncate_then_rewrite_equals_writing_fresh(llama, dtype):
    """Rejected tokens leave no trace: not in kept pages (their slots are zeroed), not in pages
    given back and handed out again (zeroed on allocation)."""
    rewritten, fresh = paged(llama, dtype, num_pages=8), paged(llama, dtype, num_pages=8)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for cache, g in ((rewritten, g1), (fresh, g2)):
        write_step(cache, {0: 30}, g)  # pages 0, 1
        write_step(cache, {0: 1}, g)
    write_step(rewritten, {0: 6}, torch.Generator().manual_seed(6), scale=100.0)  # into page 2
    assert rewritten.page_ids(0) == [0, 1, 2]
    rewritten.truncate(0, 31)  # all 6 rejected: page 2 goes back, page 1 keeps slot 14 only
    assert rewritten.page_ids(0) == [0, 1] and rewritten.stats()["used"] == 2
    for cache in (rewritten, fresh):
        write_step(cache, {0: 3}, torch.Generator().manual_seed(7))  # page 2 again
    assert rewritten.page_ids(0) == fresh.page_ids(0) == [0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(cache_bytes(rewritten), cache_bytes(fresh)))


def test_a_step_never_changes_bytes_already_written(llama):
    cache = paged(llama, num_pages=8)
    g = torch.Generator().manual_seed(8)
    write_step(cache, {0: 5}, g)
    for n, scale in ((1, 1000.0), (4, 0.001), (9, 50.0)):  # huge, tiny, across a page boundary
        before, start = cache_bytes(cache), cache.length(0)
        write_step(cache, {0: n}, g, scale)
        for b, a in zip(before, cache_bytes(cache)):
            for p, page in enumerate(cache.page_ids(0)):
                lo = min(max(start - p * 16, 0), 16)  # slots of this page written before the step
                assert torch.equal(b[:, page, :, :lo], a[:, page, :, :lo])


@pytest.mark.parametrize("dtype", [KVDtype.FP8_E4M3, KVDtype.BF16], ids=["fp8", "bf16"])
def test_multi_token_step_equals_one_token_steps(llama, dtype):
    """Speculative verification in one call: k+1 tokens per sequence, two sequences, written
    together and attending causally among themselves, give the logits of feeding them one at a
    time; rollback is then a truncate. The attention is bit for bit the one-token kernel's (see
    tests/kernels); what remains is the matmuls' float32 round-off, which on CPU BLAS depends on
    the number of rows (measured max |dlogit| 2e-6)."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (14, 29)]
    drafts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 3)]
    m = llama.model
    batched, single = paged(llama, dtype), paged(llama, dtype)
    for cache in (batched, single):
        m(torch.cat(prompts), cache.prepare([0, 1], [14, 29]), cache)
    got = m(torch.cat(drafts), batched.prepare([0, 1], [5, 3]), batched).split([5, 3])
    for seq, d, rows in zip((0, 1), drafts, got):
        expect = torch.cat([m(d[i:i + 1], single.prepare([seq], [1]), single) for i in range(len(d))])
        torch.testing.assert_close(rows, expect, rtol=0, atol=1e-4)
        assert torch.equal(rows.argmax(-1), expect.argmax(-1))
    batched.truncate(0, 14 + 2)  # accept 2 of 5
    nxt = torch.tensor([7])
    single.truncate(0, 14 + 2)
    torch.testing.assert_close(m(nxt, batched.prepare([0], [1]), batched),
                               m(nxt, single.prepare([0], [1]), single), rtol=0, atol=1e-4)


def test_format_1_spec_is_refused(llama):
    old = dataclasses.replace(KVPageSpec.for_model(llama.config), scale_granularity=ScaleGranularity.PER_PAGE_HEAD,
                              scale_dtype=ScaleDtype.FLOAT32, format_version=1)
    with pytest.raises(ValueError, match="not supported by this build"):
        PagedKVCache(llama.config, old, 8)


def test_long_chunk_after_context_matches_dense(llama):
    """More than MAX_PAGED_QUERIES new tokens after context take the dequantize + sdpa path."""
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(0, VOCAB, (90,), generator=g)
    cache, dense = paged(llama, KVDtype.BF16), DenseKVCache(llama.config, 1, 96)
    m = llama.model
    for cc in (cache, dense):
        m(ids[:10], cc.prepare([0], [10]), cc)
    n = MAX_PAGED_QUERIES + 6
    got = m(ids[10:10 + n], cache.prepare([0], [n]), cache)
    expect = m(ids[10:10 + n], dense.prepare([0], [n]), dense)
    assert (got - expect).abs().max().item() < 0.05
