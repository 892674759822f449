"""Talking to real serving engines (vLLM, SGLang): start them, send them chats, read their
counters. Nothing here imports an engine: they run as separate programs, as users run them."""
