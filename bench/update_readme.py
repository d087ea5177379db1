"""Copy bench/results/latest.md and docs/architectures.md into README.md between their markers.

Headings move two levels down (# becomes ###) so the copies sit under README sections; image
links of the benchmark report are made relative to the repository root.

Run from anywhere:  python bench/update_readme.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"
SECTIONS = (("bench", RESULTS / "latest.md"), ("archs", ROOT / "docs" / "architectures.md"))


def nest(text: str, levels: int = 2) -> str:
    """text with every markdown heading `levels` deeper, to sit inside a README section."""
    return re.sub(r"^(#{1,6}) ", lambda m: "#" * min(6, len(m.group(1)) + levels) + " ", text,
                  flags=re.MULTILINE)


def rebase_images(text: str, source: Path) -> str:
    """text with relative image links rewritten from source's folder to the repository root."""
    prefix = source.parent.relative_to(ROOT).as_posix()
    if prefix == ".":
        return text
    return re.sub(r"!\[([^\]]*)\]\((?![a-z]+://|/)([^)]+)\)", lambda m: f"![{m.group(1)}]({prefix}/{m.group(2)})", text)


def replace_between(readme: str, key: str, body: str) -> str:
    """readme with the text between <!-- key:start --> and <!-- key:end --> set to body."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    i = readme.find(start)
    j = readme.find(end, i + len(start)) if i >= 0 else -1
    if i < 0 or j < 0:
        raise KeyError(f"README.md lacks the markers {start} ... {end}")
    return readme[: i + len(start)] + "\n" + body.strip() + "\n" + readme[j:]


def main() -> int:
    """Rewrite README.md in place; exit 1 if a marker pair or a source file is missing."""
    if not README.exists():
        print(f"{README} does not exist", file=sys.stderr)
        return 1
    text = README.read_text()
    for key, source in SECTIONS:
        if not source.exists():
            print(f"{source} does not exist; produce it first (see its generator in bench/)",
                  file=sys.stderr)
            return 1
        try:
            text = replace_between(text, key, nest(rebase_images(source.read_text(), source)))
        except KeyError as e:
            print(f"{e.args[0]}; add them where the {source.name} contents belong", file=sys.stderr)
            return 1
    README.write_text(text)
    print(f"updated {README} from {', '.join(str(s.relative_to(ROOT)) for _, s in SECTIONS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
