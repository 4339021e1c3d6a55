"""Distil a draft head (kvwire/model/draft_head.py) for SmolLM2-135M-Instruct from the target, on CPU.

    nice -n 5 python -m tools.train_draft_head --minutes 55

Method and details: tools/README.md, section ``tools/train_draft_head.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waiting: the CPU is often shared
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kvwire.config import QuantMode  # noqa: E402
from kvwire.model.draft_head import DraftHead, DraftHeadConfig, save_draft_head  # noqa: E402
from kvwire.model.registry import resolve_model_path  # noqa: E402
from kvwire.runtime import EngineConfig, load_engine  # noqa: E402
from tools import draft_data  # noqa: E402
from tools.train_draft import add_budget_args, generate_answers, recorded_args, start, teacher_pass  # noqa: E402

TARGET = "smollm2-135m-instruct"
OUT = draft_data.REPO / "models" / "smollm2-draft-head"


class Flat:
    """Every labelled position of every sequence, concatenated; ``starts(unroll)`` lists the
    positions s with s + unroll still inside s's sequence (answer positions ``answer_weight`` times)."""

    def __init__(self, data, answer_from: list[int]):
        self.ids = torch.cat([d[0] for d in data])  # [N]
        self.h = torch.cat([d[1] for d in data])  # [N, H] fp16
        self.tid = torch.cat([d[2] for d in data]).long()  # [N, k]
        self.tlp = torch.cat([d[3] for d in data]).float()  # [N, k]
        self.bounds, at = [], 0
        for d, a in zip(data, answer_from):
            self.bounds.append((at, at + len(d[0]), at + a))
            at += len(d[0])

    def starts(self, unroll: int, answer_weight: int = 1) -> torch.Tensor:
        out = []
        for lo, hi, ans in self.bounds:
            s = torch.arange(lo, hi - unroll)
            out.append(s)
            out += [s[s >= ans]] * (answer_weight - 1)
        return torch.cat(out)


def chained(head: DraftHead, flat: Flat, s: torch.Tensor, unroll: int):
    """Yield, per chained step j, (predicted f [B, H], index of the position it should equal)."""
    f = flat.h[s].float()
    for j in range(unroll):
        f = head.hidden(f, flat.ids[s + j + 1])
        yield f, s + j + 1


def loss_fn(head, flat, s, embed, head_vocab, negatives: int, hidden_weight: float, unroll: int):
    tid = flat.tid[torch.cat([s + j + 1 for j in range(unroll)])]
    cand = torch.unique(torch.cat([head_vocab, tid.flatten(), torch.randint(0, embed.shape[0], (negatives,))]))
    where = torch.full((embed.shape[0],), -1, dtype=torch.long)
    where[cand] = torch.arange(len(cand))
    w_cand = embed[cand]  # [C, H]
    loss, kls, matches = 0.0, [], []
    for j, (f, at) in enumerate(chained(head, flat, s, unroll)):
        logp = torch.log_softmax((f @ w_cand.T).float(), dim=-1)  # [B, C]
        p = torch.softmax(flat.tlp[at], dim=-1)  # the teacher's top-k, renormalised
        kl = (p * (p.clamp_min(1e-9).log() - logp.gather(1, where[flat.tid[at]]))).sum(-1).mean()
        tgt = flat.h[at].float()
        mse = ((f.float() - tgt) ** 2).mean() / (tgt ** 2).mean()
        loss = loss + (kl + hidden_weight * mse) / (j + 1)
        kls.append(float(kl))
        matches.append(float((cand[logp.argmax(-1)] == flat.tid[at, 0]).float().mean()))
    return loss, kls, matches


@torch.no_grad()
def agreement(head: DraftHead, flat: Flat, unroll: int, answer_only: bool = True) -> list[float]:
    """Top-1 agreement with the target over the reduced head, per chained step (held-out data)."""
    s = flat.starts(unroll)
    if answer_only:
        keep = torch.zeros(len(flat.ids), dtype=torch.bool)
        for lo, hi, ans in flat.bounds:
            keep[ans:hi] = True
        s = s[keep[s]]
    hits = [0.0] * unroll
    for i in range(0, len(s), 4096):
        for j, (f, at) in enumerate(chained(head, flat, s[i:i + 4096], unroll)):
            pred = head.head_vocab[(f @ head.head.weight[:len(head.head_vocab)].T).argmax(-1)]
            hits[j] += float((pred == flat.tid[at, 0]).sum())
    return [round(h / max(1, len(s)), 4) for h in hits]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_budget_args(ap, OUT, minutes=55.0, prompts=3000, max_tokens=160, gen_share=0.3, export_minutes=1.0)
    ap.add_argument("--everyday-share", type=float, default=0.0,
                    help="share of the chat prompts that are everyday requests (tools/draft_data.py)")
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--unroll", type=int, default=3, help="chained steps trained on the head's own output")
    ap.add_argument("--negatives", type=int, default=1024)
    ap.add_argument("--hidden-weight", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=512, help="positions per step")
    args = ap.parse_args()
    t_start, budget = start(args)

    corpus = draft_data.load_corpus("train")
    prompts = draft_data.chat_prompts(corpus, args.prompts, args.seed, everyday_share=args.everyday_share)
    chats, _ = generate_answers(prompts, budget * args.gen_share, args.max_tokens, args.gen_batch, args.threads)
    t_gen = time.time() - t_start

    path = resolve_model_path(TARGET)
    target = load_engine(EngineConfig(path, weights=QuantMode.INT8))
    model, cfg = target.model, target.model_config
    label_seconds = budget * args.label_share + max(0.0, budget * args.gen_share - t_gen)
    data, answer_from, t0 = [], [], time.time()
    for p, a in tqdm(chats, desc="labels", unit="chat", dynamic_ncols=True):
        if time.time() - t0 > label_seconds:
            break
        ids = p + a
        data.append((torch.tensor(ids), *teacher_pass(model, ids, args.topk)))
        answer_from.append(len(p))
    t_label = time.time() - t_start - t_gen
    held = [i for i in range(len(data)) if i % 20 == 19]
    train_idx = [i for i in range(len(data)) if i % 20 != 19]
    flat = Flat([data[i] for i in train_idx], [answer_from[i] for i in train_idx])
    flat_held = Flat([data[i] for i in held], [answer_from[i] for i in held])
    del data

    model.embed.weight.requires_grad_(False)
    embed = model.embed.weight.detach().float()  # [V, H], the target's (tied LM head)
    counts = torch.bincount(flat.tid[:, 0], minlength=cfg.vocab_size)
    specials = torch.tensor(sorted(set(cfg.eos_token_ids)))
    head_vocab = torch.unique(torch.cat([counts.argsort(descending=True)[:args.head_vocab - len(specials)], specials]))
    hcfg = DraftHeadConfig(cfg.hidden_size, args.intermediate, args.blocks, len(head_vocab), cfg.vocab_size,
                           cfg.rms_norm_eps, target.fingerprint.weights_sha256, target.fingerprint.tokenizer_sha256)
    head = DraftHead(hcfg, model.embed)
    with torch.no_grad():
        h = cfg.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)  # starts as "f_{t+1} = f_t"
        for b in head.blocks:
            torch.nn.init.normal_(b.gate_up.weight, std=h ** -0.5)
            b.down.weight.zero_()
        head.head.weight[:len(head_vocab)] = embed[head_vocab]
        head.head_vocab.copy_(head_vocab)
    params = [p for n, p in head.named_parameters() if not n.startswith("head.")]
    for p in params:
        p.requires_grad_(True)
    before = agreement(head, flat_held, args.unroll)

    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    starts = flat.starts(args.unroll, answer_weight=2)
    # at least a second: a budget the data phases used up still trains (and ends), rather than looping on a negative one
    train_seconds = max(1.0, budget - (time.time() - t_start) - args.export_minutes * 60)
    t0, step, ema = time.time(), 0, None
    bar = tqdm(total=int(train_seconds), desc="train", unit="s", dynamic_ncols=True)
    while (frac := (time.time() - t0) / train_seconds) < 1:
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        s = starts[torch.randint(0, len(starts), (args.batch,))]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, kls, matches = loss_fn(head, flat, s, embed, head_vocab, args.negatives, args.hidden_weight,
                                         args.unroll)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        cur = kls[:1] + matches
        ema = cur if ema is None else [0.98 * e + 0.02 * c for e, c in zip(ema, cur)]
        bar.n = int(time.time() - t0)
        bar.set_postfix(step=step, kl=f"{ema[0]:.3f}", top1="/".join(f"{m:.2f}" for m in ema[1:]))
    bar.close()
    t_train = time.time() - t0
    for p in params:
        p.requires_grad_(False)
    after = agreement(head, flat_held, args.unroll)
    after_all = agreement(head, flat_held, args.unroll, answer_only=False)

    summary = {
        "command": f"python -m tools.train_draft_head --minutes {args.minutes:g}",
        "args": recorded_args(args),
        "chats": len(chats), "labelled_chats": len(train_idx) + len(held), "held_out_chats": len(held),
        "train_positions": len(flat.ids), "train_answer_positions": sum(hi - a for _, hi, a in flat.bounds),
        "head_vocab": len(head_vocab),
        "head_vocab_coverage_held_out": round(float(torch.isin(flat_held.tid[:, 0], head_vocab).float().mean()), 4),
        "steps": step, "epochs": round(step * args.batch / len(starts), 2),
        "held_out_top1_per_chained_step_answers": {"before": before, "after": after},
        "held_out_top1_per_chained_step_all": after_all,
        "seconds_answers": round(t_gen, 1), "seconds_labels": round(t_label, 1), "seconds_train": round(t_train, 1),
        "threads": args.threads,
    }
    save_draft_head(head, args.out, {"target": TARGET, "trained": summary["command"]})
    summary["seconds_total"] = round(time.time() - t_start, 1)
    summary["weights_bytes"] = (args.out / "model.safetensors").stat().st_size
    (args.out / "train_stats.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
