"""A draft head: speculative proposals from the target's own hidden state (EAGLE-style, no attention).

A standalone draft model must rebuild, from tokens alone, what the target already knows about the
context; with a 135M target it costs a third of a target step per drafted token and agrees too
rarely to pay (docs/decisions/040-standalone-draft-model.md). This head reads instead the target's final normed hidden
state ``f_t`` (what the target's LM head turns into token ``t + 1``) together with the embedding of
the token that was chosen at ``t + 1``, and predicts ``f_{t+1}``; the target's own LM head rows
(a reduced vocabulary: the tokens the target emits most) turn that into the next proposal. Further
proposals chain on the head's own prediction:

    f_t, x_{t+1}  -> fc([f ; norm(embed(x))]) -> + SwiGLU MLP blocks -> f^_{t+1} -> head -> x^_{t+2}
    f^_{t+1}, x^_{t+2} -> ...                                                          -> x^_{t+3}

No attention and so no KV cache of its own: the target's hidden state carries the context, a
proposal costs a few small matmuls, rollback costs nothing, and the split needs nothing from
prefill_svc (the first feature comes from the first decode step's target forward).

Files (a directory): ``draft_head.json`` (``DraftHeadConfig`` + the target it was trained for) and
``model.safetensors`` (``fc.weight``, ``tok_norm.weight``, ``blocks.{i}.norm.weight``,
``blocks.{i}.gate_up.weight``, ``blocks.{i}.down.weight``, ``head.weight`` [head_vocab, hidden] and
``head_vocab`` [head_vocab] int64). ``tools/train_draft_head.py`` trains one.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvwire.files import LoadError
from kvwire.model.linear import Linear
from kvwire.model.model import RMSNorm
from kvwire.model.quant import quantize_model

CONFIG_FILE = "draft_head.json"
WEIGHTS_FILE = "model.safetensors"
MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
SHIPPED = {"smollm2-135m-instruct": "smollm2-draft-head"}  # registered model -> its head in models/


@dataclass(frozen=True)
class DraftHeadConfig:
    hidden_size: int
    intermediate_size: int
    num_blocks: int
    head_vocab: int  # rows of the reduced LM head
    vocab_size: int  # the target's
    rms_norm_eps: float
    target_weights_sha256: str = ""  # the target model it was distilled from ("" = not checked)
    target_tokenizer_sha256: str = ""


def is_draft_head(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def shipped_head(model: str | Path) -> Path | None:
    """The head this repository ships for a registered model name, if any."""
    name = SHIPPED.get(str(model))
    return MODELS_DIR / name if name and is_draft_head(MODELS_DIR / name) else None


class HeadBlock(nn.Module):
    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)  # rows [gate | up]
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).split(self.inter, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DraftHead(nn.Module):
    """``embed``: the target's input embedding table [vocab, hidden] (shared, never copied)."""

    def __init__(self, cfg: DraftHeadConfig, embed: nn.Embedding):
        super().__init__()
        self.cfg = cfg
        self.embed = [embed]  # a list: not a submodule, so neither saved nor quantized with the head
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.tok_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.blocks = nn.ModuleList(HeadBlock(cfg) for _ in range(cfg.num_blocks))
        # rows padded (zeros) to a multiple of 16: the int8 CPU kernels' layout (kvwire.model.quant.vnni_layout)
        self.head = Linear(cfg.hidden_size, -(-cfg.head_vocab // 16) * 16)
        self.register_buffer("head_vocab", torch.zeros(cfg.head_vocab, dtype=torch.int64))

    def hidden(self, feature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """feature: [S, hidden] (f_t), tokens: [S] (x_{t+1}) -> f^_{t+1} [S, hidden] (differentiable)."""
        e = self.tok_norm(self.embed[0](tokens).float())  # [S, hidden]
        x = self.fc(torch.cat([feature.float(), e], dim=-1))  # [S, hidden]
        for block in self.blocks:
            x = block(x)
        return x

    @torch.inference_mode()
    def forward(self, feature: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (f^_{t+1} [S, hidden], logits over the head vocabulary [S, head_vocab] fp32)."""
        x = self.hidden(feature, tokens)
        return x, self.head(x)[:, :self.cfg.head_vocab].float()


def load_draft_head(path: str | Path, embed: nn.Embedding) -> DraftHead:
    """Read a head directory (weights fp32; quantize afterwards with ``quantize_model``)."""
    from safetensors.torch import load_file
    path = Path(path)
    cfg = DraftHeadConfig(**json.loads((path / CONFIG_FILE).read_text())["config"])
    head = DraftHead(cfg, embed)
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(path / WEIGHTS_FILE).items()}
    w = state.get("head.weight")
    if w is not None and w.shape[0] < head.head.out_features:  # saved without the padding rows
        state["head.weight"] = torch.cat([w, w.new_zeros(head.head.out_features - w.shape[0], w.shape[1])])
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path / WEIGHTS_FILE}: missing {missing}, unexpected {unexpected}")
    if int(head.head_vocab.max()) >= cfg.vocab_size:
        raise ValueError(f"{path / WEIGHTS_FILE}: head_vocab ids past the vocabulary ({cfg.vocab_size})")
    return head


def save_draft_head(head: DraftHead, path: str | Path, extra: dict | None = None) -> Path:
    """Weights in bf16 (the head vocabulary int64), config as JSON."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, path / WEIGHTS_FILE)
    (path / CONFIG_FILE).write_text(json.dumps({"config": asdict(head.cfg), **(extra or {})}, indent=2) + "\n")
    return path


def load_for_target(path: str | Path, target, weights) -> DraftHead:
    """The head in ``path`` for the loaded ``target`` (a ``kvwire.runtime.Runtime``), its layers in
    ``weights`` mode (``kvwire.config.QuantMode``; int8 is the fast one). A head distilled from other
    weights is a LoadError naming both hashes: its features would not be the target's."""
    try:
        head = load_draft_head(path, target.model.embed)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise LoadError(f"draft head {path}: {e}") from e
    cfg, tcfg = head.cfg, target.model_config
    if (cfg.vocab_size, cfg.hidden_size) != (tcfg.vocab_size, tcfg.hidden_size):
        raise LoadError(f"draft head {path} is for a vocabulary of {cfg.vocab_size} and width {cfg.hidden_size}; "
                        f"the target has {tcfg.vocab_size} and {tcfg.hidden_size}")
    want, have = cfg.target_weights_sha256, target.checkpoint_sha256 or target.fingerprint.weights_sha256
    if want and want != have:
        raise LoadError(f"draft head {path} was distilled from other target weights (sha256 {want[:12]}, "
                        f"target {have[:12]}): train one for this model "
                        "(tools/train_draft_head.py)")
    return quantize_model(head, weights, include_lm_head=True)
