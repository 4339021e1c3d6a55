"""Train kvwire's embedded default models from scratch on CPU.

Method and details: tools/README.md, section ``tools/train_embedded.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waiting: the CPU is often shared
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import (Tokenizer, decoders, models, pre_tokenizers, processors,  # noqa: E402
                        trainers)
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS, EOS, PAD = 0, 1, 2  # ids follow SPECIALS order
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TARGET = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=768)
DRAFT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=384)
COMMAND = "python tools/train_embedded.py"
SAMPLE_PROMPTS = ["The for statement", "A class definition", "The import statement",
                  "Exceptions can be raised"]


def load_corpus():
    """Sorted topic names, every 10th held out; train paragraphs that also occur verbatim in a
    held-out topic (pydoc topics quote each other) are dropped so the held-out set stays unseen."""
    from pydoc_data.topics import topics
    names = sorted(topics)
    held = names[::10]
    seen = {p.strip() for n in held for p in topics[n].split("\n\n") if len(p.strip()) > 40}
    train = ["\n\n".join(p for p in topics[n].split("\n\n") if p.strip() not in seen)
             for n in names if n not in held]
    return train, [topics[n] for n in held], held


def train_tokenizer(texts, vocab_size, max_len):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS[:3]] == [BOS, EOS, PAD]
    # Encoding plain text prepends <|bos|> (as in training); chat templates carry their own.
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS)])
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
           "eos_token": "<|eos|>", "pad_token": "<|pad|>", "model_max_length": max_len,
           "clean_up_tokenization_spaces": False, "add_bos_token": True,
           "chat_template": CHAT_TEMPLATE}
    return tok, cfg


def save_tokenizer(tok, cfg, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def check_tokenizer(out: Path):
    hf = AutoTokenizer.from_pretrained(out)
    for s in ["for x in range(3):\n    print(x)", "안녕하세요 세계", "emoji 🎉👍🏽 ok", "中文テキスト",
              "  odd  spacing\t\ttabs\n"]:
        ids = hf(s)["input_ids"]
        assert ids[0] == BOS and hf.decode(ids, skip_special_tokens=True) == s, s
    chat = hf.apply_chat_template([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}],
                                  tokenize=False, add_generation_prompt=True)
    assert chat == "<|bos|><|system|>Be brief.\n<|user|>Hi\n<|assistant|>", chat


def stream(tok, texts):
    ids = []
    for t in texts:  # encode() adds <|bos|> via the post-processor
        ids += tok.encode(t).ids + [EOS]
    return torch.tensor(ids, dtype=torch.long)


def make_model(arch, vocab, max_pos, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=max_pos, rope_theta=10000.0,
                      tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS,
                      pad_token_id=PAD, rms_norm_eps=1e-5, attention_dropout=0.0,
                      architectures=["LlamaForCausalLM"], **arch)
    return LlamaForCausalLM(cfg).float()


def n_params(model):  # tied embeddings counted once
    return sum(p.numel() for p in model.parameters())


def train(model, data, steps, batch, seq, lr, max_minutes, seed, desc, held=None, every=0,
          teacher=None, kd=0.0):
    """AdamW, linear warmup then cosine decay to 10% of peak. Schedule progress is
    max(step / steps, elapsed / cap): on an idle machine the step count decides (reproducible);
    on a loaded one the wall-clock cap anneals and ends training on time instead. With a teacher,
    the loss is (1 - kd) * CE + kd * KL(teacher || model) (distillation, for the draft)."""
    g = torch.Generator().manual_seed(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warm, cap = max(1, steps // 20), max_minutes * 60
    model.train()
    t0, ema, done, progress = time.time(), None, 0, 0.0
    bar = tqdm(total=steps, desc=desc, dynamic_ncols=True)
    while progress < 1.0:
        cur = lr * min(1.0, (done + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = cur
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        x = torch.stack([data[s:s + seq] for s in starts])
        out = model(input_ids=x, labels=x)
        loss = out.loss
        if teacher is not None:
            with torch.no_grad():
                t_logp = teacher(x).logits[:, :-1].log_softmax(-1).flatten(0, 1)
            s_logp = out.logits[:, :-1].log_softmax(-1).flatten(0, 1)
            kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
            loss = (1 - kd) * out.loss + kd * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done += 1
        ce = out.loss.item()
        ema = ce if ema is None else 0.95 * ema + 0.05 * ce
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{cur:.2e}")
        if every and held is not None and done % every == 0:
            model.eval()
            bar.write(f"{desc} step {done}: held-out loss {heldout_loss(model, held, seq):.4f}")
            model.train()
        progress = max(done / steps, (time.time() - t0) / cap)
    bar.close()
    model.eval()
    capped = done < steps
    if capped:
        print(f"{desc}: wall-clock cap of {max_minutes} min ended training at step {done}/{steps}")
    return {"steps": done, "seconds": time.time() - t0, "tokens": done * batch * seq,
            "train_loss_ema": ema, "capped": capped, "planned": steps}


@torch.no_grad()
def heldout_loss(model, data, seq):
    tot, n = 0.0, 0
    for i in range(0, len(data) - 1, seq):
        x = data[i:i + seq].unsqueeze(0)
        if x.shape[1] < 2:
            break
        tot += model(input_ids=x, labels=x).loss.item() * (x.shape[1] - 1)
        n += x.shape[1] - 1
    return tot / n


@torch.no_grad()
def agreement(target, draft, data, n_prompts, prompt_len, gen_len):
    step = (len(data) - prompt_len) // n_prompts
    prompts = torch.stack([data[i * step:i * step + prompt_len] for i in range(n_prompts)])
    seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                           max_new_tokens=gen_len, min_new_tokens=gen_len, pad_token_id=PAD)
    gen = seqs[:, prompt_len:]
    pos = slice(prompt_len - 1, seqs.shape[1] - 1)  # logits predicting generated tokens
    t_self = (target(seqs).logits[:, pos].argmax(-1) == gen).float().mean().item()
    agree = (draft(seqs).logits[:, pos].argmax(-1) == gen).float().mean().item()
    return agree, t_self


@torch.no_grad()
def continue_text(model, tok, prompt, n=60):
    ids = torch.tensor([tok.encode(prompt).ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, pad_token_id=PAD, eos_token_id=EOS)
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def save_model(model, tok, tok_cfg, out: Path, max_len):
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS,
                                               pad_token_id=PAD, do_sample=False,
                                               max_length=max_len)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, tok_cfg, out)


def card(name, role, model, arch, stats, ev, common, extra=""):
    a = {**arch, "vocab_size": model.config.vocab_size,
         "max_position_embeddings": model.config.max_position_embeddings,
         "rope_theta": 10000.0, "tie_word_embeddings": True}
    rows = "\n".join(f"| {k} | {v} |" for k, v in a.items())
    return f"""# {name}

{role} Trained from scratch on CPU by `{COMMAND}`
(fp32, seed {common['seed']}). Not a useful language model: a tiny, reproducible stand-in with
real weights for tests and benchmarks.

## Architecture

`LlamaForCausalLM`, {n_params(model):,} parameters (tied input/output embeddings counted once).

| field | value |
|---|---|
{rows}

## Tokenizer

Byte-level BPE (HF `tokenizers`), vocab {common['vocab']}, specials
{', '.join(f'`{s}`' for s in SPECIALS)}.
Plain encoding prepends `<|bos|>`; documents end with `<|eos|>`. `tokenizer_config.json` holds a
chat template rendering `<|system|>...\\n<|user|>...\\n<|assistant|>`. Shared by both embedded models.

## Training

- Corpus: `pydoc_data.topics` of Python {common['python']}
  ({common['n_train']} topics train, {common['n_held']} held out: sorted names, every 10th; train
  paragraphs quoted verbatim in a held-out topic dropped; {common['train_tokens']:,} train /
  {common['held_tokens']:,} held-out tokens).
- Sequence length {common['seq']}, batch {common['batch']}, AdamW (betas 0.9/0.95, wd 0.1),
  peak lr {stats['lr']}, linear warmup then cosine to 10%, grad clip 1.0; torch {torch.__version__},
  transformers {common['transformers']}, {common['threads']} CPU threads.{stats.get('note', '')}
- Steps: {stats['steps']:,} of {stats['planned']:,} planned ({stats['tokens']:,} tokens seen,
  final train cross-entropy ~{stats['train_loss_ema']:.3f}), wall time {stats['seconds'] / 60:.1f} min
  {'(ended by the wall-clock cap, so not bit-reproducible)' if stats['capped'] else '(step budget)'}.

## Evaluation (held-out topics)

- Loss {ev['loss']:.4f} nats/token, perplexity {math.exp(ev['loss']):.2f}.
- Greedy agreement, draft vs target: {common['agree']:.3f} ({common['n_prompts']} held-out prompts of
  {common['prompt_len']} tokens; {common['gen_len']} greedy target tokens each, teacher-forced through the
  draft; fraction of positions where the draft's argmax equals the target's token).
{extra}"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="models", help="parent dir of the two model dirs")
    ap.add_argument("--target-steps", type=int, default=500)
    ap.add_argument("--draft-steps", type=int, default=350)
    ap.add_argument("--target-max-minutes", type=float, default=16.0, help="wall-clock safety cap")
    ap.add_argument("--draft-max-minutes", type=float, default=6.5, help="wall-clock safety cap")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--draft-kd", type=float, default=0.7,
                    help="weight of the distillation (KL to target) term in the draft's loss")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out eval every N steps")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_pos = 2048
    print(f"python {sys.version}\ntorch {torch.__version__}")
    t_start = time.time()

    train_txt, held_txt, held_names = load_corpus()
    tok, tok_cfg = train_tokenizer(train_txt, args.vocab, max_pos)
    out_t, out_d = Path(args.out) / "kvwire-tiny", Path(args.out) / "kvwire-tiny-draft"
    save_tokenizer(tok, tok_cfg, out_t)
    check_tokenizer(out_t)
    train_ids, held_ids = stream(tok, train_txt), stream(tok, held_txt)
    print(f"vocab {tok.get_vocab_size()}, train tokens {len(train_ids):,}, "
          f"held-out tokens {len(held_ids):,} ({', '.join(held_names)})")

    target = make_model(TARGET, tok.get_vocab_size(), max_pos, args.seed)
    draft = make_model(DRAFT, tok.get_vocab_size(), max_pos, args.seed + 1)
    pt, pd = n_params(target), n_params(draft)
    print(f"target {pt:,} params, draft {pd:,} params, ratio {pt / pd:.2f}x")
    assert 5 <= pt / pd <= 10, "draft must be 5-10x smaller than target"

    st = train(target, train_ids, args.target_steps, args.batch, args.seq, args.target_lr,
               args.target_max_minutes, args.seed, "target", held_ids, args.eval_every)
    st["lr"] = args.target_lr
    sd = train(draft, train_ids, args.draft_steps, args.batch, args.seq, args.draft_lr,
               args.draft_max_minutes, args.seed + 1, "draft", held_ids, args.eval_every,
               teacher=target, kd=args.draft_kd)
    sd["lr"] = args.draft_lr
    sd["note"] = (f"\n- Distilled from `kvwire-tiny`: loss = {1 - args.draft_kd:.1f} * cross-entropy + "
                  f"{args.draft_kd:.1f} * KL(target || draft).")

    ev_t = {"loss": heldout_loss(target, held_ids, args.seq)}
    ev_d = {"loss": heldout_loss(draft, held_ids, args.seq)}
    prompt_len, gen_len = 32, 64
    agree, t_self = agreement(target, draft, held_ids, args.prompts, prompt_len, gen_len)
    samples = {p: continue_text(target, tok, p) for p in SAMPLE_PROMPTS}
    d_sample = continue_text(draft, tok, SAMPLE_PROMPTS[0])
    print(f"target held-out loss {ev_t['loss']:.4f} ppl {math.exp(ev_t['loss']):.2f} | "
          f"draft held-out loss {ev_d['loss']:.4f} ppl {math.exp(ev_d['loss']):.2f}")
    print(f"draft/target greedy agreement {agree:.3f} (target self-check {t_self:.3f})")
    for p, s in samples.items():
        print(f"--- target: {p!r}\n{s}")
    print(f"--- draft: {SAMPLE_PROMPTS[0]!r}\n{d_sample}")

    import transformers
    common = dict(seed=args.seed, vocab=tok.get_vocab_size(), python=sys.version.replace("\n", " "),
                  n_train=len(train_txt), n_held=len(held_txt), train_tokens=len(train_ids),
                  held_tokens=len(held_ids), seq=args.seq, batch=args.batch,
                  transformers=transformers.__version__, threads=args.threads, agree=agree,
                  n_prompts=args.prompts, prompt_len=prompt_len, gen_len=gen_len)
    fence = "```"
    t_extra = (f"\n## Sample (greedy, prompt `{SAMPLE_PROMPTS[0]}`)\n\n{fence}text\n"
               f"{samples[SAMPLE_PROMPTS[0]]}\n{fence}\n\nDraft model: `kvwire-tiny-draft` "
               f"({pd:,} parameters, {pt / pd:.1f}x fewer).\n")
    d_extra = (f"\nTarget model: `kvwire-tiny` ({pt:,} parameters, {pt / pd:.1f}x more); the two "
               f"share `tokenizer.json`.\n")
    save_model(target, tok, tok_cfg, out_t, max_pos)
    save_model(draft, tok, tok_cfg, out_d, max_pos)
    (out_t / "README.md").write_text(card("kvwire-tiny", "Target model of kvwire's embedded defaults.",
                                          target, TARGET, st, ev_t, common, t_extra))
    (out_d / "README.md").write_text(card("kvwire-tiny-draft", "Draft model (speculative decoding) "
                                          "of kvwire's embedded defaults.", draft, DRAFT, sd, ev_d,
                                          common, d_extra))
    for d in (out_t, out_d):
        check_tokenizer(d)
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d}: {size / 2**20:.1f} MiB ({', '.join(sorted(f.name for f in d.iterdir()))})")
    print(f"total wall time {(time.time() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main()
