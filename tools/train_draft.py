"""Distil a draft model for SmolLM2-135M-Instruct from the target itself, on CPU, in a time budget.

    nice -n 5 python -m tools.train_draft --minutes 60

Method and details: tools/README.md, section ``tools/train_draft.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waiting: the CPU is often shared
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kvwire import LLM, SamplingParams  # noqa: E402
from kvwire.config import DType, ModelConfig  # noqa: E402
from kvwire.model.loader import load_model  # noqa: E402
from kvwire.model.model import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from kvwire.tokenizer import ChatMessage  # noqa: E402
from tools import draft_data  # noqa: E402
from tools.draft_gguf import check, export  # noqa: E402

TARGET = "smollm2-135m-instruct"
OUT = draft_data.REPO / "models" / "smollm2-draft"


# ---- the target as teacher -------------------------------------------------------------------------

class _Causal:
    """The KV-cache protocol for one whole sequence: plain causal attention, nothing stored."""

    def attend(self, layer, q, k, v, window):  # q [T, h, d]; k, v [T, hkv, d]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)  # [T, h, d]


@torch.inference_mode()
def teacher_pass(model, ids: list[int], topk: int):
    """Final normed hidden [T, H] (fp16) and top-k next-token (ids [T, k] int32, log-probs [T, k] fp16)."""
    x = model.embed(torch.tensor(ids)).float()
    cos, sin = rope_cos_sin(model.inv_freq, torch.arange(len(ids)))
    for block in model.layers:
        x = block(x, cos, sin, _Causal())
    h = model.norm(x)  # [T, H]
    lp = torch.log_softmax(model.lm_head(h).float(), dim=-1)  # [T, V]
    top = lp.topk(topk, dim=-1)
    return h.half(), top.indices.int(), top.values.half()


# ---- the student ------------------------------------------------------------------------------------

class Block(nn.Module):
    """A target block, trainable: the same fused parameters as kvwire.model.model.Block."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor]):
        super().__init__()
        self.h, self.hkv, self.d, self.eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        self.p = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(v.float().clone()) for k, v in state.items()})

    def forward(self, x, cos, sin):  # x [B, T, H]
        p, (b, t, _) = self.p, x.shape
        y = F.rms_norm(x, (x.shape[-1],), p["attn_norm_weight"], self.eps)
        q, k, v = F.linear(y, p["attn_qkv_weight"]).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q = apply_rope(q.view(b, t, self.h, self.d), cos, sin).transpose(1, 2)  # [B, h, T, d]
        k = apply_rope(k.view(b, t, self.hkv, self.d), cos, sin).transpose(1, 2)
        v = v.view(b, t, self.hkv, self.d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(b, t, -1), p["attn_o_weight"])
        y = F.rms_norm(x, (x.shape[-1],), p["mlp_norm_weight"], self.eps)
        gate, up = F.linear(y, p["mlp_gate_up_weight"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, p["mlp_down_weight"])


class Student(nn.Module):
    def __init__(self, cfg: ModelConfig, target_state: dict[str, torch.Tensor], layers: list[int]):
        super().__init__()
        self.cfg, self.source_layers = cfg, layers
        self.register_buffer("embed", target_state["embed.weight"].float().clone())  # [V, H], frozen
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim))
        self.blocks = nn.ModuleList(
            Block(cfg, {k[len(f"layers.{i}."):]: v for k, v in target_state.items() if k.startswith(f"layers.{i}.")})
            for i in layers)
        self.norm = nn.Parameter(target_state["norm.weight"].float().clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, T] -> normed hidden [B, T, H]
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(ids.shape[1]))  # [T, 1, d]
        x = F.embedding(ids, self.embed)
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg.rms_norm_eps)


# ---- phases -----------------------------------------------------------------------------------------

def generate_answers(prompts: list[str], seconds: float, max_tokens: int, batch: int, threads: int):
    """(prompt ids, answer ids) for as many prompts as the budget allows, target greedy."""
    llm = LLM(TARGET, weights="int8", kv_dtype="fp8_e4m3", num_pages=4096, max_running=batch)
    torch.set_num_threads(threads)
    tok, t0, out = llm.tokenizer, time.time(), []
    bar = tqdm(total=len(prompts), desc="answers", unit="prompt", dynamic_ncols=True)
    for i in range(0, len(prompts), batch):
        if time.time() - t0 > seconds:
            break
        ids = [tok.encode(tok.apply_chat_template([ChatMessage("user", p)]), add_special_tokens=False)
               for p in prompts[i:i + batch]]
        for p, c in zip(ids, llm.generate(ids, SamplingParams(max_tokens=max_tokens))):
            out.append((p, c.token_ids))
        bar.update(len(ids))
    bar.close()
    return out, tok


def label(model, seqs: list[list[int]], seconds: float, topk: int):
    t0, out = time.time(), []
    for s in tqdm(seqs, desc="labels", unit="seq", dynamic_ncols=True):
        if time.time() - t0 > seconds:
            break
        out.append((torch.tensor(s), *teacher_pass(model, s, topk)))
    return out


def batches(data, max_tokens: int, rng: random.Random):
    """Indices grouped by similar length, at most ``max_tokens`` (padded) tokens a batch; shuffled."""
    order = sorted(range(len(data)), key=lambda i: len(data[i][0]))
    groups, cur = [], []
    for i in order:
        if cur and len(data[i][0]) * (len(cur) + 1) > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    rng.shuffle(groups)
    return groups


def collate(data, idx):
    t = max(len(data[i][0]) for i in idx)
    ids = torch.zeros(len(idx), t, dtype=torch.long)
    mask = torch.zeros(len(idx), t, dtype=torch.bool)
    hid = torch.zeros(len(idx), t, data[idx[0]][1].shape[-1])
    tid = torch.zeros(len(idx), t, data[idx[0]][2].shape[-1], dtype=torch.long)
    tlp = torch.zeros(len(idx), t, data[idx[0]][3].shape[-1])
    for r, i in enumerate(idx):
        s, h, ti, tl = data[i]
        n = len(s)
        ids[r, :n], mask[r, :n], hid[r, :n], tid[r, :n], tlp[r, :n] = s, True, h.float(), ti.long(), tl.float()
    return ids, mask, hid, tid, tlp


def loss_fn(student, batch, head_vocab: torch.Tensor, negatives: int, hidden_weight: float):
    """KL to the teacher's top-k (renormalised) over a candidate set (head vocabulary, every labelled
    id, random negatives) + relative MSE to the teacher's hidden state. Returns (loss, kl, mse, top-1 match)."""
    ids, mask, hid, tid, tlp = batch
    h = student(ids)[mask]  # [N, H]
    tid, tlp, hid = tid[mask], tlp[mask], hid[mask]  # [N, k], [N, k], [N, H]
    vocab = student.embed.shape[0]
    cand = torch.unique(torch.cat([head_vocab, tid.flatten(), torch.randint(0, vocab, (negatives,))]))
    where = torch.full((vocab,), -1, dtype=torch.long)
    where[cand] = torch.arange(len(cand))
    logp = torch.log_softmax(h @ student.embed[cand].T, dim=-1)  # [N, C]
    p = torch.softmax(tlp, dim=-1)  # teacher's top-k, renormalised
    kl = (p * (p.clamp_min(1e-9).log() - logp.gather(1, where[tid]))).sum(-1).mean()
    mse = ((h - hid) ** 2).mean() / (hid ** 2).mean()
    match = (cand[logp.argmax(-1)] == tid[:, 0]).float().mean()
    return kl + hidden_weight * mse, kl.detach(), mse.detach(), match


def train(student, data, head_vocab, seconds: float, args) -> dict:
    rng = random.Random(args.seed)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    t0, step, ema, epoch = time.time(), 0, None, 0
    bar = tqdm(total=int(seconds), desc="train", unit="s", dynamic_ncols=True)
    done = False
    while not done:
        epoch += 1
        for idx in batches(data, args.batch_tokens, rng):
            frac = (time.time() - t0) / seconds
            if frac >= 1:
                done = True
                break
            lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            # bf16 matmuls (AVX512-BF16), fp32 master weights and softmax (see docs/decisions/040-standalone-draft-model.md).
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, kl, mse, match = loss_fn(student, collate(data, idx), head_vocab, args.negatives,
                                               args.hidden_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            cur = torch.stack([kl, mse, match]).float().tolist()
            ema = cur if ema is None else [0.95 * e + 0.05 * c for e, c in zip(ema, cur)]
            bar.n = int(time.time() - t0)
            bar.set_postfix(step=step, epoch=epoch, kl=f"{ema[0]:.3f}", mse=f"{ema[1]:.3f}", top1=f"{ema[2]:.3f}")
    bar.close()
    return {"steps": step, "epochs": epoch, "seconds": round(time.time() - t0, 1), "kl_ema": round(ema[0], 4),
            "hidden_mse_ema": round(ema[1], 4), "train_top1_match_ema": round(ema[2], 4)}


def add_budget_args(ap: argparse.ArgumentParser, out: Path, minutes: float, prompts: int, max_tokens: int,
                    gen_share: float, export_minutes: float) -> None:
    """The arguments of every distillation script here (this one, tools/train_draft_head.py): the
    wall-clock budget and its phases, the answers, the labels, the head vocabulary, threads, seed."""
    ap.add_argument("--minutes", type=float, default=minutes, help="wall-clock budget of the whole run")
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--prompts", type=int, default=prompts, help="chat prompts offered to the answer phase")
    ap.add_argument("--max-tokens", type=int, default=max_tokens, help="answer length")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--gen-share", type=float, default=gen_share, help="share of the budget for answers")
    ap.add_argument("--label-share", type=float, default=0.2, help="share of the budget for teacher labels")
    ap.add_argument("--export-minutes", type=float, default=export_minutes, help="kept back for export")
    ap.add_argument("--topk", type=int, default=16, help="teacher log-probabilities kept per position")
    ap.add_argument("--head-vocab", type=int, default=8192, help="most frequent target tokens kept in the "
                    "(reduced) draft head vocabulary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)


def start(args: argparse.Namespace) -> tuple[float, float]:
    """Threads and seed set; returns (start time, budget in seconds)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    return time.time(), args.minutes * 60


def recorded_args(args: argparse.Namespace) -> dict[str, str]:
    """``args`` as train_stats.json records them: paths inside the repository relative to it."""
    def show(v):
        if isinstance(v, Path) and v.resolve().is_relative_to(draft_data.REPO):
            return str(v.resolve().relative_to(draft_data.REPO))
        return str(v)
    return {k: show(v) for k, v in vars(args).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_budget_args(ap, OUT, minutes=60.0, prompts=1200, max_tokens=128, gen_share=0.25, export_minutes=1.5)
    ap.add_argument("--layers", default="0,10,19,29", help="target layers the draft's blocks start from")
    ap.add_argument("--text-tokens", type=int, default=384, help="length of a plain-text passage")
    ap.add_argument("--negatives", type=int, default=2048)
    ap.add_argument("--hidden-weight", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    args = ap.parse_args()
    t_start, budget = start(args)

    corpus = draft_data.load_corpus("train")
    prompts = draft_data.chat_prompts(corpus, args.prompts, args.seed)
    chats, tok = generate_answers(prompts, budget * args.gen_share, args.max_tokens, args.gen_batch, args.threads)
    t_gen = time.time() - t_start

    texts = draft_data.text_chunks(corpus)
    random.Random(args.seed).shuffle(texts)
    plain = []
    for t in texts[:4000]:
        ids = tok.encode(t, add_special_tokens=False)
        plain += [ids[i:i + args.text_tokens] for i in range(0, len(ids) - 32, args.text_tokens)]
    seqs = [p + a for p, a in chats]
    # Chats first (what the draft will see), then plain text interleaved with the rest.
    seqs += [s for s in plain if len(s) >= 32]
    target = load_model(TARGET, dtype=DType.BF16)
    cfg = target.config
    label_seconds = budget * args.label_share + max(0.0, budget * args.gen_share - t_gen)
    data = label(target.model, seqs, label_seconds, args.topk)
    t_label = time.time() - t_start - t_gen

    counts = torch.bincount(torch.cat([d[2][:, 0] for d in data]).long(), minlength=cfg.vocab_size)
    specials = torch.tensor(sorted(set(cfg.eos_token_ids) | {1, 2}))
    head_vocab = torch.unique(torch.cat([counts.argsort(descending=True)[:args.head_vocab], specials]))
    layers = [int(x) for x in args.layers.split(",")]
    state = {k: v for k, v in target.model.state_dict().items()}
    student = Student(cfg, state, layers)
    del target
    train_seconds = max(1.0, budget - (time.time() - t_start) - args.export_minutes * 60)
    stats = train(student, data, head_vocab, train_seconds, args)

    args.out.mkdir(parents=True, exist_ok=True)
    path = export(student, head_vocab.tolist(), args.out / "smollm2-draft.gguf")
    export_diff = check(student, path, data[0][0][:96].tolist())
    n_label = sum(len(d[0]) for d in data)
    summary = {
        "command": f"python -m tools.train_draft --minutes {args.minutes:g}",
        "args": recorded_args(args),
        "chats": len(chats), "chat_prompt_tokens": sum(len(p) for p, _ in chats),
        "chat_answer_tokens": sum(len(a) for _, a in chats), "labelled_sequences": len(data),
        "labelled_tokens": n_label, "head_vocab": len(head_vocab),
        "head_vocab_coverage_train": round(float(counts[head_vocab].sum() / counts.sum()), 4),
        "source_layers": layers, "train": stats, "seconds_answers": round(t_gen, 1),
        "seconds_labels": round(t_label, 1), "seconds_total": round(time.time() - t_start, 1),
        "threads": args.threads, "gguf_bytes": path.stat().st_size,
        "export_max_abs_logit_diff": round(export_diff, 4),
    }
    (args.out / "train_stats.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
