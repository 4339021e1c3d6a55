"""A draft head's greedy proposals in one C call (``kvw_draft_head_chain`` in kvwire_kernels/cpu).

Chained from Python (``kvwire.spec.head.HeadProposer``'s fallback), a proposal is a dozen torch
ops, each starting cold right after a target step (see docs/decisions/023-draft-head.md).
``FastHead`` runs the same chain in C: the same
matmul kernels on the same weights (``fast_decode.linear_desc``), the C RMSNorm and SiLU the fused
decode step uses, the argmax and softmax's top probability computed over the head vocabulary.
A sampling chain draws each proposal in Python (from the head vocabulary's distribution, with the
request's seeded generator) and calls ``forward``, one C call per head evaluation.

Numerics: the matmuls are the very ones the torch path calls; the norms are the C step's, which
differ from ``F.rms_norm`` in the last bits, so on a near tie the two paths may propose different
tokens. Proposals never change the output (verification decides), only how many are accepted.
"""
from __future__ import annotations

import ctypes

import torch

from kvwire_kernels import cpu
from kvwire.model.draft_head import DraftHead
from kvwire.model.fast_decode import linear_desc


class FastHead:
    """Built once per loaded head (``build``); called once per step for every greedy drafting
    sequence (``__call__``), or once per proposal of a sampling chain (``forward``)."""

    def __init__(self, lib, desc: cpu.DraftHeadDesc, keep: list):
        self.lib, self.desc = lib, desc
        self._keep = keep  # the tensors (and block array) whose pointers the descriptor holds
        self.hidden, self.head_vocab, self.rows = desc.hidden, desc.head_vocab_n, desc.head.out_features

    @classmethod
    def build(cls, head: DraftHead) -> "FastHead | None":
        """None where the C kernels are unavailable or a layer is of a kind they do not read."""
        lib = cpu.library()
        embed = getattr(head.embed[0], "weight", None)  # [vocab, hidden]: the target's, shared (None: GGUF blocks)
        if embed is None:
            return None
        embed = embed.detach()
        if lib is None or embed.device.type != "cpu" or embed.dtype not in (torch.float32, torch.bfloat16) \
                or not embed.is_contiguous():
            return None
        keep: list = []
        blocks = (cpu.HeadBlockDesc * len(head.blocks))()
        for desc, block in zip(blocks, head.blocks):
            lins = [linear_desc(block.gate_up, keep), linear_desc(block.down, keep)]
            if any(d is None for d in lins):
                return None
            norm = block.norm.weight.detach().float().contiguous()
            keep.append(norm)
            desc.norm, (desc.gate_up, desc.down) = norm.data_ptr(), lins
        fc, out = linear_desc(head.fc, keep), linear_desc(head.head, keep)
        if fc is None or out is None:
            return None
        cfg = head.cfg
        tok_norm, vocab = head.tok_norm.weight.detach().float().contiguous(), head.head_vocab.contiguous()
        keep += [embed, tok_norm, vocab, blocks]
        desc = cpu.DraftHeadDesc(embed.data_ptr(), int(embed.dtype == torch.bfloat16), tok_norm.data_ptr(), fc,
                                 ctypes.addressof(blocks), len(head.blocks), out, vocab.data_ptr(), vocab.shape[0],
                                 cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps)
        return cls(lib, desc, keep)

    def __call__(self, features: torch.Tensor, tokens: list[int], ks: list[int],
                 stop_below: float) -> tuple[list[list[int]], list[list[float]], int]:
        """features: [S, hidden] (each sequence's f_t), tokens: [S] (its pending token), ks: at most
        this many proposals each. Returns (proposals, their confidences) per sequence and the head
        evaluations made (the longest chain): what ``HeadProposer.draft`` computes for greedy requests."""
        S, kmax = len(tokens), max(ks, default=0)
        feats = features.float().contiguous()  # [S, hidden]
        toks, k = torch.tensor(tokens, dtype=torch.int64), torch.tensor(ks, dtype=torch.int64)
        out_tok, out_conf = torch.empty(S, kmax, dtype=torch.int64), torch.empty(S, kmax)
        calls = self.lib.kvw_draft_head_chain(ctypes.byref(self.desc), S, feats.data_ptr(), toks.data_ptr(),
                                              k.data_ptr(), kmax, stop_below, out_tok.data_ptr(), out_conf.data_ptr(),
                                              torch.get_num_threads())
        props, confs = [], []
        for t, c in zip(out_tok.tolist(), out_conf.tolist()):
            n = next((j for j, x in enumerate(t) if x < 0), len(t))
            props.append(t[:n])
            confs.append(c[:n])
        return props, confs, int(calls)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``DraftHead.forward`` in one C call (for a chain that samples each proposal in Python):
        features [S, hidden], tokens [S] -> (f^_{t+1} [S, hidden], logits over the head vocabulary
        [S, head_vocab] fp32)."""
        S = tokens.shape[0]
        feats, toks = features.float().contiguous(), tokens.to(torch.int64).contiguous()
        x, logits = torch.empty(S, self.hidden), torch.empty(S, self.rows)
        self.lib.kvw_draft_head_eval(ctypes.byref(self.desc), S, feats.data_ptr(), toks.data_ptr(), x.data_ptr(),
                                     logits.data_ptr(), torch.get_num_threads())
        return x, logits[:, :self.head_vocab]
