#!/usr/bin/env python3
"""Writes pkg/tokenizer/classes_hf.go: where HF `tokenizers` sees Unicode differently from Go.

1. Character classes: HF's regexes (Oniguruma) know Unicode 16.0, Go 1.27's unicode tables
   17.0. The table is what tokenizers itself matches: Split(Regex(r"\\p{L}"), "removed") etc.
   over every code point, compared with Go's unicode.Is* (computed by `go run`).
2. Normalization: HF's NFC/NFKC (the unicode-normalization-alignments crate) uses much older
   Unicode data than golang.org/x/text (17.0 on Go 1.27): code points it does not know are left alone
   (combining class 0, no decomposition, no composition). Found by probing HF with every code
   point whose normalization is not trivial in Go: a combining mark HF does not reorder, a
   decomposition or composition HF does not apply.

Usage: gen_classes.py OUT.go  (needs: pip install tokenizers==0.23.3; go with golang.org/x/text
in the module cache: run it from pkg/)
"""
import json
import os
import subprocess
import sys
import tempfile

import tokenizers
from tokenizers import Regex, normalizers, pre_tokenizers

CLASSES = [("L", r"\p{L}", 1), ("N", r"\p{N}", 2), ("M", r"\p{M}", 4), ("P", r"\p{P}", 8), ("S", r"\p{S}", 16), ("WS", r"\s", 32)]

GO_PROG = r'''package main

import (
	"fmt"
	"os"
	"unicode"

	"golang.org/x/text/unicode/norm"
)

func hexs(x, s string) string {
	if x == s {
		return "-"
	}
	out := ""
	for _, r := range x {
		out += fmt.Sprintf("%x.", r)
	}
	return out
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "norm" {
		for c := rune(0); c < 0x110000; c++ {
			if c >= 0xD800 && c <= 0xDFFF {
				continue
			}
			s := string(c)
			p := norm.NFC.PropertiesString(s)
			nfc, nfkc, nfd := norm.NFC.String(s), norm.NFKC.String(s), norm.NFD.String(s)
			if p.CCC() == 0 && nfc == s && nfkc == s && nfd == s && p.BoundaryBefore() {
				continue
			}
			fmt.Println(int(c), p.CCC(), hexs(nfc, s), hexs(nfkc, s), hexs(nfd, s))
		}
		return
	}
	for c := rune(0); c < 0x110000; c++ {
		if c >= 0xD800 && c <= 0xDFFF {
			continue
		}
		b := 0
		switch {
		case unicode.IsLetter(c):
			b |= 1
		case unicode.IsNumber(c):
			b |= 2
		case unicode.IsMark(c):
			b |= 4
		case unicode.IsPunct(c):
			b |= 8
		case unicode.IsSymbol(c):
			b |= 16
		}
		if unicode.IsSpace(c) {
			b |= 32
		}
		if b != 0 {
			fmt.Println(int(c), b)
		}
	}
	fmt.Println("version", unicode.Version)
	fmt.Println("normversion", norm.Version)
}
'''


def hf_bits():
    cps = [c for c in range(0x110000) if not (0xD800 <= c <= 0xDFFF)]
    bits = {}
    for _, pat, bit in CLASSES:
        sp = pre_tokenizers.Split(Regex(pat), behavior="removed")
        members = set(cps)
        for i in range(0, len(cps), 50000):
            chunk = cps[i:i + 50000]
            for piece, _ in sp.pre_tokenize_str("".join(chr(c) for c in chunk)):
                for ch in piece:
                    members.discard(ord(ch))
        for c in members:
            bits[c] = bits.get(c, 0) | bit
    return bits


def run_go(*args):
    d = tempfile.mkdtemp(dir=".")  # inside the module, so golang.org/x/text resolves
    try:
        with open(os.path.join(d, "main.go"), "w") as f:
            f.write(GO_PROG)
        return subprocess.run(["go", "run", "./" + os.path.basename(d)] + list(args), capture_output=True, text=True, check=True).stdout
    finally:
        import shutil
        shutil.rmtree(d)


def go_bits():
    out = run_go()
    bits, version, norm_version = {}, "", ""
    for line in out.splitlines():
        a, b = line.split()
        if a == "version":
            version = b
        elif a == "normversion":
            norm_version = b
        else:
            bits[int(a)] = int(b)
    return bits, version, norm_version


def parse(h, c):
    return c if h == "-" else "".join(chr(int(x, 16)) for x in h.strip(".").split("."))


def norm_unknown():
    """Code points HF's NFC (resp. NFKC) leaves alone although Go's tables normalize them."""
    nfc_n, nfkc_n = normalizers.NFC(), normalizers.NFKC()
    unk_c, unk_k = set(), set()
    rows = [line.split() for line in run_go("norm").splitlines()]
    # The code points that take part in a composition HF performs: HF knows them, so they must
    # stay normalizable even when a newer Unicode adds a composition with them (Unicode 16's
    # Todhri letters compose with U+0307; marking U+0307 inert would stop e + U+0307 -> U+0117).
    composes = set()
    lacking = []
    for cp, ccc, nfc, nfkc, nfd in rows:
        c = chr(int(cp))
        d = parse(nfd, c)
        if d != c and parse(nfc, c) == c:
            if nfc_n.normalize_str(d) == c:
                composes.update(ord(x) for x in d)
            else:
                lacking.append((c, d))
    for cp, ccc, nfc, nfkc, nfd in rows:
        c, ccc = chr(int(cp)), int(ccc)
        if ccc > 0:  # does HF reorder it against a mark of another class?
            probe, moved = ("#" + c + "\u0334", "#\u0334" + c) if ccc > 1 else ("#\u0345" + c, "#" + c + "\u0345")
            h = nfc_n.normalize_str(probe)
            if h == probe and nfc_n.normalize_str(moved) != probe:
                unk_c.add(int(cp))
                unk_k.add(int(cp))
        if parse(nfc, c) != c and nfc_n.normalize_str(c) == c:
            unk_c.add(int(cp))
        if parse(nfkc, c) != c and nfkc_n.normalize_str(c) == c:
            unk_k.add(int(cp))
    for c, d in lacking:  # a composition HF lacks: the composite and the parts HF composes nothing with
        for x in [c] + [x for x in d if ord(x) not in composes]:
            unk_c.add(ord(x))
            unk_k.add(ord(x))
    return unk_c, unk_k


def ranges_of(cps):
    out = []
    for c in sorted(cps):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def main(out):
    hf = hf_bits()
    go, go_version, norm_version = go_bits()
    diff = sorted(c for c in set(hf) | set(go) if hf.get(c, 0) != go.get(c, 0))
    ranges = []
    for c in diff:
        b = hf.get(c, 0)
        if ranges and ranges[-1][1] == c - 1 and ranges[-1][2] == b:
            ranges[-1][1] = c
        else:
            ranges.append([c, c, b])
    with open(out, "w") as f:
        f.write("// Code generated by testdata/gen/gen_classes.py; DO NOT EDIT.\n\n")
        f.write("package tokenizer\n\n")
        f.write("// The Unicode versions these tables were computed against: Go's unicode package and\n")
        f.write("// golang.org/x/text/unicode/norm. TestTablesMatchToolchain fails (\"regenerate\") when the\n")
        f.write("// toolchain or x/text in use has other tables.\n")
        f.write(f"const (\n\ttablesUnicodeVersion = \"{go_version}\"\n\ttablesNormVersion    = \"{norm_version}\"\n)\n\n")
        f.write(f"// hfClassOverrides lists the code points whose character classes in Hugging Face\n")
        f.write(f"// tokenizers {tokenizers.__version__} (Oniguruma) differ from Go's unicode tables ({go_version}):\n")
        f.write(f"// {len(diff)} code points in {len(ranges)} ranges, {{lo, hi, class bits}} ascending.\n")
        f.write("var hfClassOverrides = [...]classRange{\n")
        for lo, hi, b in ranges:
            f.write(f"\t{{0x{lo:x}, 0x{hi:x}, {b}}},\n")
        f.write("}\n")
        unk_c, unk_k = norm_unknown()
        for name, cps, form in (("hfNFCInert", unk_c, "NFC"), ("hfNFKCInert", unk_k, "NFKC")):
            rs = ranges_of(cps)
            f.write(f"\n// {name} lists the code points HF's {form} leaves alone although golang.org/x/text\n")
            f.write(f"// normalizes them (its tables are older): {len(cps)} code points in {len(rs)} ranges.\n")
            f.write(f"var {name} = [...]classRange{{\n")
            for lo, hi in rs:
                f.write(f"\t{{0x{lo:x}, 0x{hi:x}, 0}},\n")
            f.write("}\n")
    print(f"{len(diff)} class overrides in {len(ranges)} ranges (Go {go_version}); NFC-inert {len(unk_c)}, NFKC-inert {len(unk_k)}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
