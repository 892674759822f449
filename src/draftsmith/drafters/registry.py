"""Drafter methods, one module each behind one interface (base.Method), and the table of them.
The method wing (drafters/), file by file:

    registry.py this table: METHODS, and how a drafter or an export finds its method
    options.py  what params.yaml says of the methods: names, train.<method> sections, their
                rules (torch-free: config.py imports it)
    eagle3.py   EAGLE-3 and EAGLE-3.1 (the same layer; 3.1 adds fc_norm and norm_output)
    dflash.py   DFlash: a block of masks after an anchor, drafted in one forward
    peagle.py   P-EAGLE: EAGLE-3 with a learned mask slot per depth, k drafts in one forward
    dspark.py   DSpark: DFlash's block with every slot drafting, a Markov and a confidence head
    layers.py   what they are built of: norms, rotary, the GQA and MLA attentions, the MLP
    base.py     DrafterConfig (a drafter's shape, saved with it), the Method interface
    batch.py    Batch: what every objective reads (train/data.py makes them)
    losses.py   the fused losses without whole-vocabulary logits (TTT soft CE, DFlash's CE)
    ttt_flex.py, ttt_kernels.py   EAGLE's training-time-test attention on flex attention, or
                on torch's flash or cuDNN kernel (train.attention); the dense reference is in
                eagle3.py

train/, benchmark/ and export.py ask the method for everything that differs (the model, its
loss, its proposer, its export keys, what each engine calls it, the tokens it needs of the
target), so a new method is a module here, its entry below and its name (and options) in
options.py; tests/test_methods.py holds the two equal and checks that no module outside the
wing names a method. The table is explicit: imports decide each stage's code deps.
"""

from __future__ import annotations

from draftsmith.drafters import dflash, dspark, eagle3, peagle
from draftsmith.drafters.base import DrafterConfig, Method, Objective, Proposer

METHODS: dict[str, Method] = {m.name: m for m in (eagle3.EAGLE3, eagle3.EAGLE31, dflash.DFLASH,
                                                   peagle.PEAGLE, dspark.DSPARK)}


def method_of(c: DrafterConfig) -> Method:
    return METHODS[c.method]


def build(c: DrafterConfig):
    """A freshly initialised drafter of shape c, of its method's class."""
    return method_of(c).model(c)


def method_of_export(config: dict) -> Method | None:
    """The method an exported config.json is for: ours say so; another tool's is told by its
    architecture (and EAGLE-3.1 by its switches). None: no method of ours."""
    named = config.get("draftsmith", {}).get("method")
    if named in METHODS:
        return METHODS[named]
    arch = (config.get("architectures") or [None])[0]
    found = [m for m in METHODS.values() if arch in m.architectures.values()]
    if len(found) > 1:  # EAGLE-3 and 3.1 share the architectures
        return METHODS["eagle3.1" if config.get("fc_norm") or config.get("norm_output")
                       else "eagle3"]
    return found[0] if found else None


__all__ = ["METHODS", "DrafterConfig", "Method", "Objective", "Proposer", "build", "method_of",
           "method_of_export"]
