"""Train stage: the drafter of `train.method` (drafters/), from stored hidden states.

data.py: packed rows read lazily from the hidden shards; sources.py: where the states come
from (stored, the target run here, or a serving engine: engine_feed.py); loop.py: device,
steps, evaluation, each step the method's objective (drafters/, over its fused losses);
resume.py: the checkpoints an interrupted run resumes from; select.py: the checkpoint saved
(the last, or the best by the reference engine's acceptance); parallel.py: DDP and FSDP2 under
torchrun; precision.py: the bf16 working copy over fp32 master weights.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.config import HiddenConfig, ServerConfig, TrainConfig
from draftsmith.drafters.registry import METHODS
from draftsmith.hidden_format import (check_made_as_configured, fed_by_engine,
                                     read_hidden_manifest)
from draftsmith.target_info import TargetHead, load_target_head
from draftsmith.train.loop import train
from draftsmith.train.select import AcceptanceScorer, end_of_turn_id
from draftsmith.train.sources import open_source


def run(cfg: TrainConfig, target_dir: Path, hidden_dir: Path, vocab_dir: Path, out_dir: Path,
        ckpt_dir: Path, curve_file: Path | None = None, plot_file: Path | None = None,
        tokenized_dir: Path | None = None, hidden: HiddenConfig | None = None,
        server: ServerConfig | None = None, work_dir: Path | None = None) -> dict:
    """The stage: reads only the target's embedding, lm_head and final norm, unless the hidden
    artifact is online (hidden.mode: online): then the whole target runs here, on every batch,
    or with `hidden.engine: vllm` in a vLLM server (`server`: launched, its log and files in
    work_dir, or server.urls) that captures each batch's states as training needs them."""

    def load_target(device):
        from draftsmith.capture import set_attention
        from draftsmith.target_info import load_model

        model = load_model(target_dir, str(device))
        set_attention(model, (hidden or HiddenConfig()).attention)
        return model

    manifest = read_hidden_manifest(hidden_dir)
    if hidden is not None:
        check_made_as_configured(manifest, hidden_dir, hidden.mode, hidden.engine)
    head = TargetHead(*load_target_head(target_dir))
    mask = METHODS[cfg.method].mask_token(target_dir, head.config.vocab_size)
    scorer = AcceptanceScorer(cfg, load_target, end_of_turn_id(target_dir)) \
        if cfg.select == "best_acceptance" else None
    outputs = (vocab_dir, out_dir, ckpt_dir, curve_file, plot_file, mask, scorer)
    if fed_by_engine(manifest):
        return _train_from_engine(cfg, head, outputs, manifest, target_dir, hidden_dir,
                                  tokenized_dir, hidden or HiddenConfig(),
                                  server or ServerConfig(),
                                  Path(work_dir or Path(out_dir).with_name("train.work")))
    return train(cfg, head, open_source(hidden_dir, tokenized_dir, load_target), *outputs)


def _train_from_engine(cfg: TrainConfig, head: TargetHead, outputs: tuple, manifest: dict,
                       target_dir: Path, hidden_dir: Path, tokenized_dir: Path,
                       hidden: HiddenConfig, server: ServerConfig, work_dir: Path) -> dict:
    """Online with the engine: a capture server for the whole run, and the disk its files
    took at most beside the bound on it."""
    import torch

    from draftsmith.artifacts import sample_lengths
    from draftsmith.hidden_format import kept_key
    from draftsmith.serving import hidden_states as engine
    from draftsmith.target_info import load_final_norm, read_info
    from draftsmith.train.engine_feed import DiskPeak, disk_bound

    norm, config = load_final_norm(target_dir)
    layers = manifest["aux_layers"]
    engine.check_capture(config.model_type, layers)
    states = engine.EngineStates(layers, config.num_hidden_layers, norm, config.rms_norm_eps)
    lengths = sample_lengths(tokenized_dir)
    need = _trainer_need(cfg, head, outputs[0], manifest, lengths, hidden.online_ahead)
    with engine.served_capture(server, target_dir, work_dir, states, need=need) as client, \
            DiskPeak(work_dir / "states") as disk:
        engine.check_lengths(lengths, client.max_model_len, "the server")
        keep = (work_dir / "kept", kept_key(target_dir, tokenized_dir, manifest["aux_layers"],
                                            manifest.get("dtype"))) \
            if hidden.online_keep else None
        source = open_source(hidden_dir, tokenized_dir, engine=client,
                             ahead=hidden.online_ahead, keep=keep)
        metrics = train(cfg, head, source, *outputs)
    if metrics and not server.urls:  # a launched server: its files are ours to watch
        metrics.update(engine_disk_peak_bytes=disk.peak, engine_disk_bound_bytes=disk_bound(
            server.concurrency, max(lengths.values()), len(states.ids), config.hidden_size,
            getattr(torch, read_info(target_dir).dtype)))
    return metrics


def _trainer_need(cfg: TrainConfig, head: TargetHead, vocab_dir: Path, manifest: dict,
                  lengths: dict, ahead: int):
    """What train asks of the engine it launches: requests of its longest sample, and the
    trainer's own memory beside it (engine_feed.trainer_bytes)."""
    from draftsmith.serving.memory import EngineNeed
    from draftsmith.train.engine_feed import trainer_bytes
    from draftsmith.train.loop import Runtime
    from draftsmith.vocab import load as load_vocab

    device = Runtime.resolve(cfg).device.type
    batch = cfg.batch_size * cfg.seq_len
    held = (ahead + 3) * batch + sum(sorted(lengths.values(), reverse=True)[:cfg.eval_samples])
    c = head.config
    need = trainer_bytes(batch, cfg.ttt_steps, c.hidden_size, len(manifest["aux_layers"]),
                         c.vocab_size, len(load_vocab(vocab_dir)[0]), held,
                         4 if manifest.get("dtype") == "float32" else 2, device)
    return EngineNeed("train", max(lengths.values()) + 1, need,
                      f"the trainer on the {device}: {ahead} + 3 steps' and the evaluation "
                      "samples' states, the head, the drafter and its optimizer, activations")


__all__ = ["run", "train", "TargetHead"]
