"""Where training's target states come from: one object per kind, the only thing train() asks.

- `StoredStates`: the hidden artifact's stored states (offline), read by DataLoader workers;
- `TargetHere`: online (`hidden.mode: online`), the target run by the trainer on each batch;
- `FromEngine`: online with a serving engine (`hidden.engine: vllm`), each step's states
  captured by the engine a few steps ahead of the trainer (engine_feed.py).

Each gives the same samples and the same steps (data.schedule follows the sample ids), so the
three train the same drafter from the same states; they differ only in who computes the states
and when.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.hidden_format import fed_by_engine, read_hidden_manifest
from draftsmith.train.data import HiddenStore, TokenStore, loader
from draftsmith.train.engine_feed import EngineFeed, EngineStore


class StoredStates:
    """The states as the hidden stage stored them."""

    mode = "offline"
    target = None  # the whole target, where the trainer computes the states itself

    def __init__(self, store: HiddenStore):
        self.store = store

    def start(self, device: torch.device, eval_ids: list[int]) -> None:
        """Before the drafter is built: what the first evaluation needs."""

    def batches(self, steps: list, seq_len: int, device: torch.device, workers: int):
        return iter(loader(self.store, steps, seq_len, device=device, workers=workers))

    def keeps_steps_on_failure(self) -> bool:
        """Whether a batch that failed to come is the source's fault (checkpoint the steps
        trained so far for the rerun) rather than a bug the trainer should just raise."""
        return False

    def rates(self, elapsed_s: float) -> dict:
        """The progress bar's view of the source (nothing for stored states)."""
        return {}

    def metrics(self, seconds: float) -> dict:
        return {}

    def close(self) -> None:
        pass


class TargetHere(StoredStates):
    """Online: the tokenized samples; the trainer runs the target on each batch."""

    mode = "online"

    def __init__(self, store: TokenStore, load_target):
        super().__init__(store)
        self.load_target = load_target

    def start(self, device, eval_ids):
        self.target = self.load_target(device)


class FromEngine(StoredStates):
    """Online with a serving engine (a serving.hidden_states client): the held-out samples'
    states fetched once before the first evaluation, each step's `ahead` steps early;
    keep: (folder, key) to also write them there as an offline hidden artifact
    (EngineStore.keep_in)."""

    mode = "online (engine)"

    def __init__(self, store: EngineStore, engine, ahead: int = 4,
                 keep: tuple[Path, str] | None = None):
        super().__init__(store)
        store.client = engine
        self.engine, self.ahead, self.keep, self.feed = engine, ahead, keep, None
        if keep is not None:
            store.keep_in(*keep)

    def start(self, device, eval_ids):
        self.store.fetch(eval_ids)  # held for the first and the last evaluation

    def batches(self, steps, seq_len, device, workers):
        self.feed = EngineFeed(self.store, steps, seq_len, self.ahead,
                               server_log=getattr(self.engine, "server_log", None))
        return iter(self.feed)

    def keeps_steps_on_failure(self):
        return True  # the engine failed: the steps trained so far are kept for the rerun

    def rates(self, elapsed_s):
        """Tokens a second the engine delivers, and the share of the time the trainer waited."""
        feed = self.feed
        return {"engine_tok_s": f"{feed.engine_tokens_per_s or 0:.0f}",
                "waiting": f"{feed.idle_s / max(elapsed_s, 1e-9):.0%}"} if feed else {}

    def metrics(self, seconds):
        feed = self.feed
        return {"engine_tokens": self.store.fetched,
                "engine_tokens_per_s": feed.engine_tokens_per_s if feed else None,
                "trainer_idle_share": round(feed.idle_s / seconds, 4) if feed and seconds
                else None,
                "kept_states": str(self.keep[0]) if self.keep else None}

    def close(self):
        if self.feed is not None:
            self.feed.close()


def open_source(hidden_dir: Path, tokenized_dir: Path | None = None, load_target=None,
                engine=None, ahead: int = 4,
                keep: tuple[Path, str] | None = None) -> StoredStates:
    """The source the hidden artifact calls for: stored states, or in online mode the
    tokenized samples (tokenized_dir) with the target run here (load_target(device)) or in a
    serving engine (engine)."""
    manifest = read_hidden_manifest(hidden_dir)
    if manifest.get("mode") != "online":
        return StoredStates(HiddenStore(hidden_dir))
    if tokenized_dir is None:
        raise DraftsmithError("the hidden artifact is online (no states stored) but no "
                              "tokenized data was given", "pass the tokenized artifact")
    if fed_by_engine(manifest):
        if engine is None:
            raise DraftsmithError("the hidden artifact is online with a serving engine, but "
                                  "no engine was given", "pass engine (the train stage does)")
        return FromEngine(EngineStore(tokenized_dir, hidden_dir), engine, ahead, keep)
    if load_target is None:
        raise DraftsmithError("hidden.mode is online but the target model was not given",
                              "pass load_target (the train stage does)")
    return TargetHere(TokenStore(tokenized_dir, hidden_dir), load_target)
