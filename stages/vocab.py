"""Stage `vocab`: the draft vocabulary (top loss-masked tokens) and its d2t/t2d maps."""

from draftsmith import target_info, vocab
from draftsmith.config import check_draft_vocab
from draftsmith.stage import stage_main


def run(cfg, a):
    info = target_info.read_info(a.target)
    check_draft_vocab(cfg.vocab, info.vocab_size)
    return vocab.run(cfg.vocab, a.tokenized, info.vocab_size, a.out)


if __name__ == "__main__":
    stage_main("vocab", run, paths=["target", "tokenized", "out"])
