"""LLM: the in-process engine, usable with no server (nano-vllm's interface).

    from kvwire import LLM, SamplingParams
    llm = LLM("models/kvwire-tiny", weights="int8", kv_dtype="fp8_e4m3")
    llm = LLM(target, draft_model_dir=draft, speculative="draft")  # the draft's weights int8 too (draft_weights=)
    [out] = llm.generate(["The cat"], SamplingParams(max_tokens=16))
    for delta in llm.stream("The cat", SamplingParams(max_tokens=16)): ...
    rid = llm.add_request([1, 2, 3], SamplingParams()); outputs = llm.step()

Paged FP8 (or bf16) KV, continuous batching with chunked prefill, preemption, speculative
decoding: the same EngineCore decode_svc serves from, driven synchronously here (every prompt
prefills locally, in the steps' chunks); calls must come from one thread.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvwire.args import EngineArgs
from kvwire.engine.build import build_engine
from kvwire.engine.request import Completion, RequestOutput
from kvwire.sampling_params import SamplingParams
from kvwire.tokenizer import ModelTokenizer

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | Path, **kwargs):
        """``kwargs``: the engine flags' names (kvwire/args/, docs/configuration.md): weights, kv_dtype,
        block_size, num_pages (512), device, draft_model_dir (alias draft_model), draft_weights,
        draft_kv_dtype, speculative, num_speculative_tokens, adaptive_speculation (alias
        speculative_adaptive), speculative_auto_off, speculative_greedy_max_batch, ngram_max, ngram_min,
        prefix_caching, max_running, max_waiting (1024). ValueError for a value out of range."""
        self.args = EngineArgs.from_llm_kwargs(model, **kwargs)
        self.tokenizer = self._tokenizer(self.args.model.model_dir)
        self.core = build_engine(self.args, extra_eos=self.tokenizer.eos_ids if self.tokenizer else ())
        self.runtime = self.core.runner.runtime

    @staticmethod
    def _tokenizer(model_dir: Path):
        try:
            return ModelTokenizer(model_dir)
        except Exception:  # noqa: BLE001 - token ids still work without one
            return None

    # ---- nano-vllm style: add requests, step until done ------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); raises kvwire.errors.InvalidRequest /
        ResourceExhausted when it cannot run. Returns its request id."""
        req = self.core.add_request(request_id or uuid.uuid4().hex, self.encode(prompt), params or SamplingParams())
        return req.request_id

    def step(self) -> list[RequestOutput]:
        """Admit what fits, then one step: a decode step over the running requests and the next
        chunks of the prompts being prefilled (their first tokens once complete). Finished
        requests are released (pages back to the pool)."""
        for req in self.core.admit():
            self.core.prefill_locally(req)
        plan = self.core.plan()
        if not plan:
            return []
        outputs, firsts = self.core.update(plan, self.core.execute(plan))
        outputs += [out for req, first in firsts for out in self.core.start_forked(req, first)]
        for out in outputs:
            if out.finished:
                self._release(out.request_id)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.core.requests)

    def abort(self, request_id: str) -> None:
        """Abort a request, every choice of it (n > 1) included."""
        req = self.core.requests.get(request_id)
        for child in req.children if req is not None else ():
            self._release(child.request_id)
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        req = self.core.requests.get(request_id)
        if req is not None:
            self.core.release(req)
            self.core.runner.free(req.seq)

    # ---- whole generations ------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Generate for every prompt (batched together); results in the prompts' order, an n > 1
        prompt's n choices in a row (``Completion.index``)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            return []
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.encode(p) for p in prompts]
        rids = [self.add_request(p, sp) for p, sp in zip(ids, plist)]
        # every choice's id (n > 1: the request's, then its children's, ``EngineCore.fork``)
        choices = [[r, *(f"{r}#{i}" for i in range(1, sp.n))] for r, sp in zip(rids, plist)]
        tokens: dict[str, list[int]] = {c: [] for cs in choices for c in cs}
        logprobs: dict[str, list] = {c: [] for cs, sp in zip(choices, plist) if sp.logprobs is not None for c in cs}
        reasons, prompt_logprobs = {}, {}
        try:
            while len(reasons) < len(tokens):
                for out in self.step():
                    tokens[out.request_id] += out.token_ids
                    if out.logprobs is not None:
                        logprobs[out.request_id] += out.logprobs
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    if out.finished:
                        reasons[out.request_id] = out.finish_reason
        finally:
            for c in tokens:
                self._release(c)
        return [Completion(c, p, tokens[c], reasons[c], self._text(tokens[c]), logprobs.get(c),
                           prompt_logprobs.get(r), i)
                for r, cs, p in zip(rids, choices, ids) for i, c in enumerate(cs)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one request's outputs (deltas) as they are generated; the last carries the finish
        reason (n > 1: each choice's last, ``RequestOutput.index`` naming it). Other queued requests
        advance too. Closing the iterator aborts the request."""
        n = (params or SamplingParams()).n
        rid = self.add_request(prompt, params)
        ids = [rid, *(f"{rid}#{i}" for i in range(1, n))]
        live = set(ids)
        try:
            while live:
                for out in self.step():
                    if out.request_id in live:
                        yield out
                        if out.finished:
                            live.discard(out.request_id)
        finally:
            for c in ids:
                self._release(c)

    def _text(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else None

    def stats(self) -> dict[str, int]:
        return self.core.stats()
