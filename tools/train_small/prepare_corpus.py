#!/usr/bin/env python3
"""Build the training corpus of lily's default model from Debian's Python documentation.

Source: the HTML of the Python 3.11 documentation, Debian package `python3.11-doc` (pulled in by
`python3-doc`; install with `apt-get install -y python3-doc`). The documentation is under the
PSF License Version 2 (see /usr/share/doc/python3.11/html/license.html and
/usr/share/doc/python3-doc/copyright); a model trained on it may be redistributed.

Output (in --out, default tools/train_small/data):
  train_docs.jsonl   one JSON object per document: {"path", "text"}
  val_docs.jsonl     held-out documents (about 3%, chosen by a hash of the path: reproducible)
  train_chat.jsonl   single-turn question/answer pairs drawn from the *training* documents only
                     (FAQ questions, glossary terms, API entries, section headings), rendered
                     later with the checkpoint's chat template so the model also answers in
                     `lily chat`
  manifest.json      file counts, sizes, sha256 of the outputs, package versions

Plain text is extracted from the main <div role="main"> of each page: headings, paragraphs,
lists, definition lists (API signatures), tables and code blocks (whitespace kept).
"""
from __future__ import annotations

import argparse
import hashlib
import html
import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser

DOC_ROOT = "/usr/share/doc/python3.11/html"
SKIP_FILES = {"search.html", "genindex.html", "genindex-all.html", "py-modindex.html", "download.html",
              "contents.html", "whatsnew/changelog.html", "bugs.html", "copyright.html"}
VAL_PERCENT = 3
# Python standard library source, Debian package libpython3.11-stdlib (PSF License): extra training
# text (code with docstrings and comments). Training split only; the validation text is documentation.
STDLIB_ROOT = "/usr/lib/python3.11"
STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "pydoc_data", "encodings", "site-packages", "dist-packages",
                    "__pycache__", "lib-dynload", "config-3.11-x86_64-linux-gnu", "lib2to3", "ensurepip",
                    "distutils"}

BLOCK_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "li", "dt", "dd", "tr", "caption",
              "blockquote", "div", "section", "ul", "ol", "dl", "table", "figure", "figcaption"}
HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}


class DocParser(HTMLParser):
    """Collects blocks (kind, text) from the main content of a Sphinx page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.in_main = False
        self.div_depth = 0          # depth of <div> nesting inside the main div
        self.skip_depth = 0         # >0 while inside an element whose text is dropped
        self.skip_stack: list[str] = []
        self.pre_depth = 0
        self.buf: list[str] = []
        self.blocks: list[tuple[str, str, str]] = []   # (kind, text, id)
        self.kind = "p"
        self.cur_id = ""
        self.prefix = ""
        self.row: list[str] = []
        self.in_cell = False
        self.list_stack: list[str] = []

    # -- helpers
    def flush(self):
        if self.in_cell:
            return
        text = "".join(self.buf)
        self.buf = []
        if self.kind == "pre":
            text = text.rstrip("\n")
            if text.strip():
                self.blocks.append(("pre", text, self.cur_id))
        else:
            text = re.sub(r"\s+", " ", text).strip()
            if text:
                self.blocks.append((self.kind, self.prefix + text, self.cur_id))
        self.prefix = ""
        self.kind = "p"
        self.cur_id = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if not self.in_main:
            if tag == "div" and a.get("role") == "main":
                self.in_main = True
                self.div_depth = 1
            return
        if tag == "div":
            self.div_depth += 1
        if self.skip_depth:
            if tag == self.skip_stack[-1]:
                self.skip_depth += 1
            return
        cls = a.get("class", "") or ""
        # permalink anchors, section numbers, and the "Source code:" boxes' trailing links are dropped
        if (tag == "a" and "headerlink" in cls) or (tag == "span" and "section-number" in cls) \
                or (tag == "div" and "sphinxsidebar" in cls) or tag in ("script", "style", "img"):
            if tag != "img":
                self.skip_depth = 1
                self.skip_stack.append(tag)
            return
        if tag == "pre":
            self.flush()
            self.kind = "pre"
            self.pre_depth += 1
            return
        if self.pre_depth:
            return
        if tag in ("td", "th"):
            self.in_cell = True
            self.buf = []
            return
        if tag == "br":
            self.buf.append(" ")
            return
        if tag in BLOCK_TAGS:
            self.flush()
            if tag in ("ul", "ol"):
                self.list_stack.append(tag)
            if tag in HEADINGS:
                self.kind = tag
            elif tag == "dt":
                self.kind = "dt"
                self.cur_id = a.get("id", "") or ""
            elif tag == "dd":
                self.kind = "dd"
            elif tag == "li":
                self.kind = "li"
                self.prefix = "  " * max(0, len(self.list_stack) - 1) + "* "
            elif tag == "tr":
                self.row = []
            elif tag == "p" and "admonition-title" in cls:
                self.kind = "note"

    def handle_endtag(self, tag):
        if not self.in_main:
            return
        if self.skip_depth:
            if tag == self.skip_stack[-1]:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_stack.pop()
            if tag == "div":
                self.div_depth -= 1
            return
        if tag == "pre":
            self.pre_depth -= 1
            if self.pre_depth == 0:
                self.flush()
            return
        if self.pre_depth:
            return
        if tag in ("td", "th"):
            cell = re.sub(r"\s+", " ", "".join(self.buf)).strip()
            self.row.append(cell)
            self.buf = []
            self.in_cell = False
            return
        if tag == "tr":
            if any(self.row):
                self.blocks.append(("tr", " | ".join(self.row), ""))
            self.row = []
            return
        if tag in BLOCK_TAGS:
            self.flush()
            if tag in ("ul", "ol") and self.list_stack:
                self.list_stack.pop()
        if tag == "div":
            self.div_depth -= 1
            if self.div_depth == 0:
                self.in_main = False

    def handle_data(self, data):
        if not self.in_main or self.skip_depth:
            return
        self.buf.append(data)


def parse_page(path: str) -> list[tuple[str, str, str]]:
    with open(path, encoding="utf-8") as f:
        p = DocParser()
        p.feed(f.read())
        p.close()
    blocks = []
    for kind, text, bid in p.blocks:
        text = text.replace("\u00b6", "").replace("\u200b", "")
        if kind != "pre":
            text = text.strip()
        if text:
            blocks.append((kind, text, bid))
    return blocks


def render(blocks) -> str:
    out = []
    for kind, text, _ in blocks:
        if kind == "note":
            out.append(text.rstrip(":") + ":")
        else:
            out.append(text)
    # merge consecutive table rows into one block
    text = "\n\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _clip(paragraphs: list[str], limit: int = 1200) -> str:
    out, n = [], 0
    for p in paragraphs:
        if out and n + len(p) > limit:
            break
        out.append(p)
        n += len(p) + 2
    return "\n\n".join(out)


SKIP_ANSWER_PREFIXES = ("Source code:", "Availability:", "Return value:", "Part of the Stable ABI")


def _pick(key: str, options: list[str]) -> str:
    """A phrasing chosen by a hash of key: varied but reproducible."""
    return options[int(hashlib.md5(key.encode()).hexdigest(), 16) % len(options)]


def chat_pairs(rel: str, blocks) -> list[dict]:
    """Question/answer pairs drawn from one page's structure."""
    pairs = []
    n = len(blocks)
    for i, (kind, text, bid) in enumerate(blocks):
        if kind in HEADINGS:
            level = int(kind[1])
            body = []
            for k2, t2, _ in blocks[i + 1:]:
                if k2 in HEADINGS:
                    break
                if k2 in ("p", "pre", "li", "note", "dd"):
                    body.append(t2)
                if len(body) >= 4:
                    break
            body = [b for b in body if not b.startswith(SKIP_ANSWER_PREFIXES)]
            if not body or not any(len(b) > 60 for b in body):
                continue
            answer = _clip(body)
            if text.endswith("?"):
                pairs.append({"q": text, "a": answer})
            elif level == 1 and " \u2014 " in text and rel.startswith("library/"):
                mod = text.split(" \u2014 ")[0].strip()
                pairs.append({"q": _pick(mod, [f"What is the {mod} module?", f"What does the {mod} module do?",
                                               f"Tell me about the {mod} module."]), "a": answer})
            elif len(text) < 80:
                pairs.append({"q": _pick(text, [f"Tell me about {text}.", f"Explain {text}.",
                                                f"What should I know about {text}?"]), "a": answer})
        elif kind == "dt":
            # glossary terms and API entries: the following blocks (up to the next entry) define them
            body = []
            for k2, t2, _ in blocks[i + 1:]:
                if k2 in HEADINGS or k2 == "dt":
                    break
                if k2 in ("p", "pre", "li", "note", "dd"):
                    body.append(t2)
                if len(body) >= 3:
                    break
            body = [b for b in body if not b.startswith(SKIP_ANSWER_PREFIXES)]
            if not body or sum(len(b) for b in body) < 40:
                continue
            d = _clip(body, 900)
            if rel == "glossary.html":
                pairs.append({"q": _pick(text, [f"What is {text} in Python?", f"What does {text} mean?",
                                                 f"Define {text}."]), "a": d})
            elif bid and re.fullmatch(r"[A-Za-z_][\w.]*", bid) and "." in bid:
                name = bid[2:] if bid.startswith("c.") else bid
                if "(" in text:
                    q = _pick(name, [f"What does {name}() do?", f"How do I use {name}()?",
                                     f"Explain {name}()."])
                else:
                    q = _pick(name, [f"What is {name}?", f"Explain {name}."])
                pairs.append({"q": q, "a": f"{text}\n\n{d}"})
    return pairs


def is_val(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < VAL_PERCENT


def _pkg_version(pkg: str) -> str:
    try:
        return subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=DOC_ROOT)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    ap.add_argument("--stdlib", default=STDLIB_ROOT, help="stdlib source folder ('' to leave it out)")
    args = ap.parse_args()
    if not os.path.isdir(args.root):
        sys.exit(f"{args.root} not found: apt-get install -y python3-doc")
    os.makedirs(args.out, exist_ok=True)
    files = []
    for dirpath, dirnames, filenames in os.walk(args.root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("_"))
        for fn in sorted(filenames):
            if fn.endswith(".html"):
                rel = os.path.relpath(os.path.join(dirpath, fn), args.root)
                if rel in SKIP_FILES or rel.startswith("genindex"):
                    continue
                files.append(rel)
    files.sort()
    stats = {"train_docs": 0, "val_docs": 0, "train_chars": 0, "val_chars": 0, "chat_pairs": 0}
    with open(os.path.join(args.out, "train_docs.jsonl"), "w") as ft, \
            open(os.path.join(args.out, "val_docs.jsonl"), "w") as fv, \
            open(os.path.join(args.out, "train_chat.jsonl"), "w") as fc:
        for rel in files:
            blocks = parse_page(os.path.join(args.root, rel))
            text = render(blocks)
            if len(text) < 200:
                continue
            split = "val" if is_val(rel) else "train"
            (fv if split == "val" else ft).write(json.dumps({"path": rel, "text": text}) + "\n")
            stats[f"{split}_docs"] += 1
            stats[f"{split}_chars"] += len(text)
            if split == "train":
                for pair in chat_pairs(rel, blocks):
                    fc.write(json.dumps(pair) + "\n")
                    stats["chat_pairs"] += 1
    if args.stdlib:
        n_files = 0
        with open(os.path.join(args.out, "train_code.jsonl"), "w") as fk:
            for dirpath, dirnames, filenames in os.walk(args.stdlib):
                dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP_DIRS)
                for fn in sorted(filenames):
                    if not fn.endswith(".py") or fn.startswith("_sysconfigdata"):
                        continue
                    path = os.path.join(dirpath, fn)
                    with open(path, encoding="utf-8", errors="replace") as f:
                        text = f.read()
                    if len(text) < 200:
                        continue
                    rel = os.path.relpath(path, args.stdlib)
                    fk.write(json.dumps({"path": "Lib/" + rel, "text": text}) + "\n")
                    n_files += 1
                    stats["code_chars"] = stats.get("code_chars", 0) + len(text)
        stats["code_files"] = n_files
    manifest = {"source": args.root, "package": "python3.11-doc " + _pkg_version("python3.11-doc"),
                "license": "PSF License Version 2 (Python documentation)", "val_percent": VAL_PERCENT,
                **stats, "sha256": {}}
    if args.stdlib:
        manifest["code_source"] = args.stdlib
        manifest["code_package"] = "libpython3.11-stdlib " + _pkg_version("libpython3.11-stdlib:amd64")
    for fn in ("train_docs.jsonl", "val_docs.jsonl", "train_chat.jsonl", "train_code.jsonl"):
        if not os.path.exists(os.path.join(args.out, fn)):
            continue
        with open(os.path.join(args.out, fn), "rb") as f:
            manifest["sha256"][fn] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
