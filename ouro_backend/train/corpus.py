"""The demo model's English corpus, from public-domain and permissively licensed text that Debian ships.

Sources (docs/demo-model.md has the licenses):
* `r-cran-janeaustenr`: Jane Austen's six novels (public domain; the package is MIT), stored as R data;
* `fortunes`: the BSD fortune-cookie files (quotations, poems, jokes), minus the ones that are not prose
  (ASCII art, code, Star Trek and Pratchett quotations, machine translations).

    python -m ouro_backend.train.corpus --out DIR

downloads the two .deb files with `apt-get download` (no installation, no root needed), unpacks them with
`dpkg-deb -x`, and writes DIR/train.txt, DIR/heldout.txt (the last `--heldout` share of every book and
fortune file) and DIR/SOURCES.txt (package versions and sha256 of the files).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import re
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

PACKAGES = ["r-cran-janeaustenr", "fortunes"]
AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"
FORTUNE_DIR = "usr/share/games/fortunes"
# Not English prose, or not the fortune files' BSD copyright.
SKIP_FORTUNES = {
    "art",
    "ascii-art",
    "debian",
    "linux",
    "linuxcookie",
    "perl",
    "computers",
    "startrek",
    "pratchett",
    "translate-me",
    "zippy",
    "knghtbrd",
    "ethnic",
}


def fetch_packages(workdir: Path) -> tuple[Path, list[str]]:
    """apt-get download + dpkg-deb -x into workdir/root; returns the root and 'name version sha256' lines."""
    root = workdir / "root"
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=workdir, check=True, capture_output=True)
    lines = []
    for deb in sorted(workdir.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        lines.append(f"{deb.name} sha256={hashlib.sha256(deb.read_bytes()).hexdigest()}")
    return root, lines


def austen_books(root: Path) -> dict[str, list[str]]:
    """The novels as lists of lines, from the package's lazy-load R database (an index of offsets into
    zlib-compressed serialized R character vectors)."""
    import rdata

    def convert(raw: bytes):
        return rdata.conversion.convert(rdata.parser.parse_data(raw))

    base = root / AUSTEN_DATA
    index = convert(gzip.decompress((base.with_suffix(".rdx")).read_bytes()))
    db = base.with_suffix(".rdb").read_bytes()
    books = {}
    for name, (offset, length) in index["variables"].items():
        chunk = db[int(offset) : int(offset) + int(length)]
        books[str(name)] = [str(x) for x in convert(zlib.decompress(chunk[4:]))]  # 4 bytes: raw length
    return books


def paragraphs(lines: list[str]) -> list[str]:
    """Hard-wrapped lines -> paragraphs (blank-line separated), whitespace collapsed."""
    out, cur = [], []
    for line in lines + [""]:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            out.append(re.sub(r"\s+", " ", " ".join(cur)).replace("_", ""))  # _emphasis_ markers
            cur = []
    return out


def fortune_files(root: Path) -> dict[str, list[str]]:
    """Each fortune file as a list of fortunes (separated by '%' lines), line breaks kept (poems)."""
    out = {}
    for f in sorted((root / FORTUNE_DIR).iterdir()):
        if f.suffix or f.name in SKIP_FORTUNES or not f.is_file():
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        items = [x.strip("\n") for x in re.split(r"^%$", text, flags=re.M)]
        out[f.name] = [x for x in items if x.strip() and "\ufffd" not in x]
    return out


def build(out: Path, heldout: float = 0.03) -> dict[str, int]:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root, sources = fetch_packages(Path(tmp))
        docs = {f"austen/{k}": paragraphs(v) for k, v in austen_books(root).items()}
        docs.update({f"fortunes/{k}": v for k, v in fortune_files(root).items()})
    train, held = [], []
    for name in sorted(docs):
        items = docs[name]
        cut = len(items) - max(1, int(len(items) * heldout))
        train += items[:cut]
        held += items[cut:]
    sep = "\n\n"
    (out / "train.txt").write_text(sep.join(train) + "\n", encoding="utf-8")
    (out / "heldout.txt").write_text(sep.join(held) + "\n", encoding="utf-8")
    (out / "SOURCES.txt").write_text(
        "\n".join(sources + [f"{k}: {len(v)} items" for k, v in sorted(docs.items())]) + "\n"
    )
    return dict(train_chars=sum(map(len, train)), heldout_chars=sum(map(len, held)), documents=len(docs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ouro_backend.train.corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--heldout", type=float, default=0.03, help="share of every document kept for evaluation")
    args = p.parse_args(argv)
    stats = build(args.out, args.heldout)
    print(f"corpus: {stats} -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
