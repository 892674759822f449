import torch
from safetensors.torch import save_file

from draftsmith import vocab
from draftsmith.atomic import write_json


def test_top_k_with_deterministic_tie_break():
    counts = torch.tensor([5, 0, 7, 5, 5, 1, 7])
    # 7,7 (ids 2,6), then the 5s by lower id (0, 3), returned in ascending id order.
    assert vocab.select(counts, 4).tolist() == [0, 2, 3, 6]


def test_d2t_offsets_and_t2d_round_trip():
    chosen = torch.tensor([0, 2, 3, 6, 9])
    d2t, t2d = vocab.maps(chosen, 12)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [0, 1, 1, 3, 5]  # offsets, not ids
    assert torch.equal(vocab.draft_ids_from_d2t(d2t), chosen)
    assert torch.equal(torch.nonzero(t2d).flatten(), chosen)
    # t2d -> draft id: the rank of the token among the chosen ones.
    for draft_id, target_id in enumerate(chosen.tolist()):
        assert int(t2d[:target_id].sum()) == draft_id


def _tokenized(tmp_path, ids, mask):
    save_file({"input_ids": torch.tensor(ids, dtype=torch.int32),
               "loss_mask": torch.tensor(mask, dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, len(ids)])}, tmp_path / "shard-00000.safetensors")
    write_json(tmp_path / "manifest.json", {"vocab_size": 10,
                                            "shards": [{"file": "shard-00000.safetensors", "ids": ["a"]}]})


def test_counts_only_loss_masked_tokens_and_pads_when_short(tmp_path):
    from draftsmith.config import VocabConfig

    _tokenized(tmp_path, [1, 1, 1, 4, 4, 5, 7], [0, 0, 0, 1, 1, 1, 0])
    m = vocab.run(VocabConfig(draft_vocab_size=4), tmp_path, 10, tmp_path / "out")
    d2t, t2d = vocab.load(tmp_path / "out")
    # Seen (masked): 4 (x2), 5. Token 1 is prompt-only. Padding: lowest unseen ids 0, 1.
    assert vocab.draft_ids_from_d2t(d2t).tolist() == [0, 1, 4, 5]
    assert m["distinct_loss_tokens"] == 2 and m["padded_tokens"] == 2
    assert m["coverage"] == 1.0
