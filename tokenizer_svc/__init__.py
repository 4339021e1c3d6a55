"""tokenizer_svc: the text front door (tokenize, chat template, incremental detokenize)."""
