"""What the benchmark scripts share, so that no script imports another: `results` (each result
file's header, the GPU's matmul ceiling for MFU), `shapes` (the 8B-shaped cases that
scale_out.py runs again under torchrun: train_ttt.py's drafter and batch, hidden_extract.py's
target, length mix and tokenized artifact) and `serving` (a server section that launches the
engine, a vLLM log's start-up phases). The scripts run as `python benchmarks/<script>.py`, so
this folder is on sys.path.
"""
