"""Procedural chat tasks whose answers carry a worked reasoning part.

They train the embedded target and supply its built-in prompts. Each task's reasoning is a
deterministic function of the prompt, so a small model can learn it and a drafter can learn
to predict the model: predictability matters more than the toy being right.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

WORDS = (
    "apple river stone cloud green tiger lamp music paper window orange silver forest candle "
    "garden rocket pencil mirror bridge winter summer planet coffee dragon marble pillow "
    "anchor basket camera desert engine feather guitar harbor island jacket kitten ladder "
    "meadow needle ocean parrot quartz saddle tunnel violin wagon yellow zebra"
).split()


OPPOSITES = dict(pair.split(":") for pair in (
    "hot:cold big:small fast:slow happy:sad light:dark early:late open:closed full:empty "
    "high:low long:short rich:poor soft:hard strong:weak wet:dry young:old loud:quiet "
    "near:far clean:dirty thick:thin brave:afraid"
).split())
SOUNDS = dict(pair.split(":") for pair in (
    "cow:moo dog:woof cat:meow duck:quack sheep:baa owl:hoot lion:roar horse:neigh "
    "pig:oink bee:buzz snake:hiss mouse:squeak frog:croak crow:caw"
).split())


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    reasoning: str
    answer: str


def _add(rng: random.Random) -> Example:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    phrasing = rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} plus {b}."])
    da, db = str(a)[::-1], str(b)[::-1]
    lines, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        lines.append(f"{x} + {y} + {carry} = {s}, write {s % 10} carry {s // 10}")
        carry = s // 10
    if carry:
        lines.append(f"write the last carry {carry}")
    return Example("add", phrasing.format(a=a, b=b), "\n".join(lines), str(a + b))


def _sort(rng: random.Random) -> Example:
    nums = [rng.randint(0, 99) for _ in range(rng.randint(3, 4))]
    phrasing = rng.choice(["Sort these numbers: {x}", "Put in ascending order: {x}"])
    rest, lines = list(nums), []
    while rest:
        m = min(rest)
        rest.remove(m)
        lines.append(f"smallest left is {m}")
    answer = " ".join(str(n) for n in sorted(nums))
    return Example("sort", phrasing.format(x=" ".join(map(str, nums))), "\n".join(lines), answer)


def _copy(rng: random.Random) -> Example:
    words = rng.sample(WORDS, rng.randint(3, 6))
    text = " ".join(words)
    # Same separators as the prompt, so the model can learn it by plain copying (induction).
    reasoning = f"I copy the words one by one: {text}."
    return Example("copy", rng.choice(["Copy: {t}", "Repeat exactly: {t}"]).format(t=text),
                   reasoning, text)


def _reverse(rng: random.Random) -> Example:
    words = rng.sample(WORDS, rng.randint(3, 5))
    rev = words[::-1]
    reasoning = "Reading from the last word back: " + " ".join(rev) + "."
    return Example("reverse", "Reverse the words: " + " ".join(words), reasoning, " ".join(rev))


def _count(rng: random.Random) -> Example:
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    lines, n = [], 0
    for ch in word:
        if ch == letter:
            n += 1
            lines.append(f"{ch} yes, {n}")
        else:
            lines.append(f"{ch} no")
    prompt = f"How many times does the letter '{letter}' appear in '{word}'?"
    return Example("count", prompt, "\n".join(lines), str(n))


def _compare(rng: random.Random) -> Example:
    a, b = rng.sample(range(10, 1000), 2)
    prompt = rng.choice(["Which is larger: {a} or {b}?", "Which number is bigger, {a} or {b}?"])
    la, lb = len(str(a)), len(str(b))
    lines = [f"{a} has {la} digits, {b} has {lb} digits"]
    if la != lb:
        lines.append(f"more digits wins: {max(a, b)}")
    else:
        for i, (x, y) in enumerate(zip(str(a), str(b))):
            lines.append(f"digit {i + 1}: {x} vs {y}")
            if x != y:
                break
    return Example("compare", prompt.format(a=a, b=b), "\n".join(lines), str(max(a, b)))


def _opposite(rng: random.Random) -> Example:
    w = rng.choice(sorted(OPPOSITES))
    prompt = rng.choice(["What is the opposite of {w}?", "Give the opposite of {w}.",
                         "Name the antonym of {w}.", "{w}: what is its opposite?"])
    return Example("opposite", prompt.format(w=w),
                   f"The word is {w}.\nIts opposite is {OPPOSITES[w]}.", OPPOSITES[w])


def _sound(rng: random.Random) -> Example:
    a = rng.choice(sorted(SOUNDS))
    prompt = rng.choice(["What sound does a {a} make?", "Which noise does a {a} make?",
                         "A {a} says what?", "How does a {a} sound?"])
    return Example("sound", prompt.format(a=a), f"The animal is a {a}.\nA {a} says {SOUNDS[a]}.",
                   SOUNDS[a])


# Fact tasks draw from a small set of facts and phrasings; a fixed quarter of the
# (phrasing, fact) prompts never appears in training, so held-out evaluation of them measures
# generalisation across phrasings rather than recall of a seen prompt.
FACT_TASKS = ("opposite", "sound")


def held_out_only(ex: Example) -> bool:
    return ex.task in FACT_TASKS and hashlib.sha256(ex.prompt.encode()).digest()[0] % 4 == 0


TASKS = {"add": _add, "sort": _sort, "copy": _copy, "reverse": _reverse, "count": _count,
         "compare": _compare, "opposite": _opposite, "sound": _sound}


def split_seed(seed: int, split: str) -> int:
    """Independent random streams per split (train, eval, generate, benchmark)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{split}".encode()).digest()[:8], "little")


def examples(n: int, seed: int, split: str) -> list[Example]:
    """n examples of the split, tasks interleaved round-robin; deterministic."""
    rng = random.Random(split_seed(seed, split))
    names = sorted(TASKS)
    out: list[Example] = []
    i = 0
    while len(out) < n:
        ex = TASKS[names[i % len(names)]](rng)
        i += 1
        if split != "train" or not held_out_only(ex):
            out.append(ex)
    return out
