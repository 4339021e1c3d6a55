"""``EngineArgs``: every service flag and every ``LLM`` keyword, declared once.

A frozen dataclass of sections (``sections.py``: model, cache, compute, scheduler, speculative, KV
source, serving, security, the outgoing peer's client TLS, the tokenizer's front door). Each field's
metadata (``arg(...)``) is its flag's help, metavar and environment variable; the flag's name is the
field's name with dashes (or ``dest``), its type, choices and default come from the field's. A
service parses only its sections (``engine_args.SERVICES``), with its own defaults (--listen port,
--num-pages); ``EngineArgs.from_llm_kwargs`` takes the same names (plus deprecated aliases) for
``LLM``. Why this shape: docs/decisions/010-one-configuration.md.

Range checks live in each section's ``__post_init__`` (ValueError naming the flag); the CLI
reports them as argparse errors (``parser.py``). ``--config FILE`` (TOML) sets any flag; flags on
the command line win. ``python -m kvwire.args --markdown`` writes docs/configuration.md.

Torch-free: the tokenizer service imports it.
"""
from kvwire.args.engine_args import SECTIONS, SERVICES, EngineArgs, ServiceSpec, section_dests, service_flags
from kvwire.args.parser import apply_config_file, make_parser, parse_args
from kvwire.args.doc import markdown
from kvwire.args.sections import (DEFAULT_DRAIN_DELAY_S, CacheArgs, DecodeRouting, ComputeArgs, KVSourceArgs, ModelArgs, PeerArgs,
                                  SchedulerArgs, SecurityArgs, ServingArgs, SpeculativeArgs, TokenizerArgs, arg)

__all__ = ["EngineArgs", "ServiceSpec", "SERVICES", "SECTIONS", "section_dests", "service_flags", "make_parser", "parse_args",
           "apply_config_file", "markdown", "arg", "DEFAULT_DRAIN_DELAY_S", "ModelArgs", "CacheArgs", "ComputeArgs",
           "SchedulerArgs", "SpeculativeArgs", "KVSourceArgs", "ServingArgs", "SecurityArgs", "PeerArgs",
           "TokenizerArgs", "DecodeRouting"]
