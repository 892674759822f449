"""Thin DVC stage scripts: each parses its paths and calls the draftsmith library.

Run as modules from the repository root (`python -m stages.tokenize ...`), so that a script
named like a standard-library module (tokenize) cannot shadow it."""
