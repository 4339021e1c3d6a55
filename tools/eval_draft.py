"""Measure the SmolLM2 draft against its target on held-out prompts (text it was not trained on).

    nice -n 5 python -m tools.eval_draft --n 8 --max-tokens 96

Method and details: tools/README.md, section ``tools/eval_draft.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from torch import nn  # noqa: E402

from kvwire import LLM, SamplingParams  # noqa: E402
from kvwire.config import KVDtype, QuantMode  # noqa: E402
from kvwire.kv.dense import DenseKVCache  # noqa: E402
from kvwire.model import gguf as kvgguf  # noqa: E402
from kvwire.model.fast_decode import FastDecode  # noqa: E402
from kvwire.model.linear import Linear  # noqa: E402
from kvwire.model.quant import quantize_model  # noqa: E402
from kvwire.model.source import model_source  # noqa: E402
from kvwire.runtime import EngineConfig, load_engine  # noqa: E402
from kvwire.tokenizer import ChatMessage  # noqa: E402
from tools import draft_data  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _shown(path) -> str:
    """A path as the report records it: relative to the repository when inside it (no machine paths)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)

TARGET = "smollm2-135m-instruct"
DRAFT = draft_data.REPO / "models" / "smollm2-draft"


def prompt_sets(n: int) -> dict[str, list[str]]:
    held = draft_data.load_corpus("heldout")
    grounded = [p for i, p in enumerate(draft_data.chat_prompts(held, 8 * n, seed=1)) if i % 8 != 7][:n]
    topics = draft_data.HELDOUT_TOPICS
    chat = [draft_data.FREE_FORMS[i % len(draft_data.FREE_FORMS)].format(t=topics[i % len(topics)]) for i in range(n)]
    return {"chat": chat, "grounded": grounded}


class SubsetHead(nn.Module):
    """Wraps a head over ``ids`` only ([rows, H] -> [rows, len(ids)]) so that it returns
    full-vocabulary logits, -inf elsewhere (argmax and sampling then stay inside ``ids``)."""

    def __init__(self, inner, ids: torch.Tensor, vocab: int):
        super().__init__()
        self.inner, self.ids, self.vocab = inner, ids, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scatter(self.inner(x), self.ids, self.vocab)


def scatter(sub: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.full((sub.shape[0], vocab), float("-inf"))
    out[:, ids] = sub
    return out


def load_draft(path: Path, weights: str, head: torch.Tensor | None, block_size: int, num_pages: int):
    """The draft as the engine loads it (``load_engine``, BF16 KV); with ``head``, its LM head cut to
    those rows (quantized like the rest, and taken by the fused decode step)."""
    rt = load_engine(EngineConfig(model_dir=path, weights=QuantMode(weights), kv_dtype=KVDtype.BF16,
                                  block_size=block_size, num_pages=num_pages))
    if head is None:
        return rt
    model = rt.model
    sub = Linear(model.cfg.hidden_size, len(head))
    sub.weight = nn.Parameter(model.embed.weight[head].float().contiguous(), requires_grad=False)
    model.lm_head = sub
    quantize_model(model, QuantMode(weights), include_lm_head=True)  # only the new head is still a Linear
    fused = FastDecode.build(model) if model.step_fn is not None else None
    model.lm_head = SubsetHead(model.lm_head, head, model.cfg.vocab_size)
    vocab = model.cfg.vocab_size
    model.step_fn = None if fused is None else (
        lambda *a: None if (out := fused(*a)) is None else scatter(out, head, vocab))
    return rt


def run(llm: LLM, ids: list[int], params: SamplingParams) -> dict:
    rid = llm.add_request(ids, params)
    req = llm.core.requests[rid]  # its counters outlive the request
    out, t0, first = [], None, True
    while True:
        done = False
        for o in llm.step():
            if o.request_id == rid:
                out += o.token_ids
                done = o.finished
        if first:
            t0, first = time.perf_counter(), False
        if done:
            break
    spec = req.spec  # None: plain decoding
    return {"tokens": out, "seconds": time.perf_counter() - t0, "drafted": spec.drafted if spec else 0,
            "accepted": spec.accepted if spec else 0, "steps": req.steps}


@torch.inference_mode()
def agreement(model, context: list[int], answer: list[int], head: torch.Tensor | None) -> tuple[int, int, int]:
    """(matches over the full vocabulary, matches within ``head``, answer tokens in ``head``)."""
    ids = context + answer
    cache = DenseKVCache(model.cfg, 1, len(ids))
    logits = model(torch.tensor(ids[:-1]), cache.prepare([0], [len(ids) - 1]), cache)[len(context) - 1:]  # [A, V]
    want = torch.tensor(answer)
    full = int((logits.argmax(-1) == want).sum())
    if head is None:
        return full, full, len(answer)
    mask = torch.full((logits.shape[-1],), float("-inf"))
    mask[head] = 0
    return full, int(((logits + mask).argmax(-1) == want).sum()), int(torch.isin(want, head).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, default=DRAFT)
    ap.add_argument("--n", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-weights", default="int8", help="draft weight mode (LLM's draft_weights)")
    ap.add_argument("--reduced-head", action="store_true")
    ap.add_argument("--auto-off", action="store_true", help="let the engine turn speculation off per request "
                    "on low acceptance (off by default here: this measures the draft itself)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(TARGET, weights="int8", kv_dtype="fp8_e4m3", num_pages=1024, draft_model=args.draft,
              draft_weights=args.draft_weights, speculative_auto_off=args.auto_off)
    torch.set_num_threads(args.threads)
    reader = kvgguf.open_gguf(model_source(args.draft).gguf)
    head = torch.tensor(kvgguf.field(reader, "kvwire.draft.head_vocab"), dtype=torch.long)
    drafts = {"draft": llm.core.draft.runtime}  # loaded by LLM, quantized as --draft-weights says
    if args.reduced_head:
        drafts["draft_reduced_head"] = load_draft(args.draft, args.draft_weights, head, 16, 1024)
    draft_model = drafts["draft"].model
    tok = llm.tokenizer
    modes = ["none", *drafts]
    report = {"draft": _shown(args.draft), "draft_weights": args.draft_weights, "k": args.k, "max_tokens": args.max_tokens,
              "auto_off": args.auto_off, "fused_decode": {m: rt.model.step_fn is not None for m, rt in drafts.items()}, "sets": {}}
    for name, prompts in prompt_sets(args.n).items():
        tot = {m: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "steps": 0} for m in modes}
        agree = [0, 0, 0, 0]
        identical = 0
        for p in prompts:
            ids = tok.encode(tok.apply_chat_template([ChatMessage("user", p)]), add_special_tokens=False)
            outs = {}
            for m in modes:
                if m in drafts:
                    llm.core.draft.runtime = drafts[m]
                sp = SamplingParams(max_tokens=args.max_tokens, speculative="none" if m == "none" else "draft",
                                    num_speculative_tokens=None if m == "none" else args.k)
                r = run(llm, ids, sp)
                outs[m] = r["tokens"]
                for key in tot[m]:
                    tot[m][key] += len(r["tokens"]) - 1 if key == "tokens" else r[key]
            identical += all(outs[m] == outs["none"] for m in modes)
            f, h, inh = agreement(draft_model, ids + outs["none"][:1], outs["none"][1:], head)
            agree = [agree[0] + f, agree[1] + h, agree[2] + inh, agree[3] + len(outs["none"]) - 1]
        res = {"prompts": len(prompts), "identical_outputs": identical,
               "teacher_forced_agreement": round(agree[0] / agree[3], 4),
               "teacher_forced_agreement_head_vocab": round(agree[1] / agree[3], 4),
               "head_vocab_coverage": round(agree[2] / agree[3], 4)}
        for m in modes:
            t = tot[m]
            res[m] = {"decode_tok_s": round(t["tokens"] / t["seconds"], 2), "tokens": t["tokens"],
                      "tokens_per_step": round(t["tokens"] / max(1, t["steps"]), 3)}
            if m != "none":
                res[m]["acceptance_rate"] = round(t["accepted"] / max(1, t["drafted"]), 4)
                res[m]["speedup"] = round(res[m]["decode_tok_s"] / res["none"]["decode_tok_s"], 3)
        report["sets"][name] = res
        print(json.dumps({name: res}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
