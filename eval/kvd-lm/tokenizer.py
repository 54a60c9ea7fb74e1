#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The kvd-lm tokenizer (eval/kvd-lm/README.md, "Tokens"), token for token as tokenizer.c.

Python 3, standard library only. Byte-level BPE: tokens 0..255 are the bytes, 256..259 the
special tokens (BOS, EOS, PAD, reserved), and merge i of a `.kvdtok` file makes token
260 + i out of two earlier ones. A tokenizer without merges (BYTES) is the byte-level one
of kvd-lm-small. Text is first cut into pieces (pieces()), and merges never cross a piece.

    import tokenizer
    tok = tokenizer.load("models/kvd-lm-base.kvdtok")   # or tokenizer.BYTES
    ids = tok.encode(b"text")                            # no BOS
    text = tok.decode(ids)                               # bytes; specials as <bos>...
    tok.vocab, tok.bytes_of(id)

As a command:

    tokenizer.py info FILE
    tokenizer.py encode FILE [--text TEXT | --file PATH]   # one line of decimal ids
    tokenizer.py train --out FILE --vocab N --corpus PATH [--corpus PATH...] [--digits]
    tokenizer.py golden FILE HAYSTACK        # the records test-tokenizer.c compares with
"""

import argparse
import heapq
import struct
import sys
import zlib

BOS, EOS, PAD, RESERVED = 256, 257, 258, 259
FIRST_MERGE = 260
VOCAB_MAX = 65536
PIECE_MAX = 64

MAGIC = b"KVDTOK\0\0"
VERSION = 1
HEADER_BYTES = 64
# magic, version, header bytes, vocab, merges, payload bytes, payload CRC, header CRC, zero[28]
HEADER_FMT = "<8s7I28s"
assert struct.calcsize(HEADER_FMT) == HEADER_BYTES
HEADER_CRC_SPAN = 32

_SPECIAL_NAMES = {BOS: b"<bos>", EOS: b"<eos>", PAD: b"<pad>", RESERVED: b"<259>"}


class FormatError(Exception):
    pass


# Byte classes of the piece rule: letters, digits, space, newline, other.
_L, _D, _S, _N, _P = range(5)
_CLASS = bytes(
    _L if (0x41 <= b <= 0x5A or 0x61 <= b <= 0x7A) else
    _D if 0x30 <= b <= 0x39 else
    _S if b == 0x20 else
    _N if b == 0x0A else _P
    for b in range(256))


def pieces(text):
    """Cuts bytes into the pieces merges stay inside (README.md, "Tokens"): a letter run,
    a punctuation run (anything but letters, digits, space and newline), each with one
    leading space if a space comes before it; up to 3 digits (a digit run is cut in threes
    from its start); a newline; a space that starts none of these. Runs longer than
    PIECE_MAX bytes are cut every PIECE_MAX bytes (the leading space counted). A cut falls
    before every space and every newline, so text joined at a space or newline gives
    the pieces of its parts."""
    out = []
    n = len(text)
    i = 0
    cls = _CLASS
    while i < n:
        c = cls[text[i]]
        start = i
        if c == _S:
            if i + 1 < n and cls[text[i + 1]] in (_L, _P):
                c = cls[text[i + 1]]
                i += 1
            else:
                out.append(text[i:i + 1])
                i += 1
                continue
        if c == _D:
            j = i
            while j < n and j - i < 3 and cls[text[j]] == _D:
                j += 1
        elif c == _N:
            j = i + 1
        else:   # a letter or punctuation run
            j = i
            while j < n and j - start < PIECE_MAX and cls[text[j]] == c:
                j += 1
        out.append(text[start:j])
        i = j
    return out


class Tokenizer:
    def __init__(self, merges):
        self.merges = list(merges)
        self.vocab = FIRST_MERGE + len(self.merges)
        self._bytes = [bytes([b]) for b in range(256)] + [_SPECIAL_NAMES[t] for t in range(256, 260)]
        self._rank = {}
        for i, (a, b) in enumerate(self.merges):
            t = FIRST_MERGE + i
            if not (a < t and b < t and not 256 <= a < FIRST_MERGE and not 256 <= b < FIRST_MERGE):
                raise FormatError(f"merge {i} ({a}, {b}) uses a special or a later token")
            if (a, b) in self._rank:
                raise FormatError(f"merge {i} ({a}, {b}) repeats merge {self._rank[(a, b)]}")
            self._rank[(a, b)] = i
            self._bytes.append(self._bytes[a] + self._bytes[b])
        self._cache = {}

    def bytes_of(self, t):
        return self._bytes[t]

    def encode_piece(self, piece):
        """The tokens of one piece: its bytes, then, while any adjacent pair is a merge,
        the leftmost pair of the lowest merge is replaced by that merge's token."""
        got = self._cache.get(piece)
        if got is not None:
            return got
        ids = list(piece)
        rank = self._rank
        while len(ids) > 1:
            best, at = None, -1
            for k in range(len(ids) - 1):
                r = rank.get((ids[k], ids[k + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, k
            if best is None:
                break
            ids[at:at + 2] = [FIRST_MERGE + best]
        ids = tuple(ids)
        if len(self._cache) < 1 << 20:
            self._cache[piece] = ids
        return ids

    def encode(self, text):
        if isinstance(text, str):
            text = text.encode()
        if not self.merges:
            return list(text)
        out = []
        for p in pieces(text):
            out.extend(self.encode_piece(p))
        return out

    def count(self, text):
        """len(encode(text))."""
        return len(text) if not self.merges else len(self.encode(text))

    def decode(self, ids):
        return b"".join(self._bytes[t] for t in ids)

    def to_bytes(self):
        payload = b"".join(struct.pack("<2I", a, b) for a, b in self.merges)
        head = struct.pack("<8s5I", MAGIC, VERSION, HEADER_BYTES, self.vocab, len(self.merges),
                           len(payload))
        head += struct.pack("<I", zlib.crc32(payload) & 0xFFFFFFFF)
        head += struct.pack("<I", zlib.crc32(head) & 0xFFFFFFFF) + bytes(28)
        assert len(head) == HEADER_BYTES
        return head + payload


BYTES = Tokenizer(())


def parse(data, name="tokenizer"):
    if len(data) < HEADER_BYTES:
        raise FormatError(f"{name}: {len(data)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, hbytes, vocab, merges, pbytes, pcrc, hcrc, zero = struct.unpack(
        HEADER_FMT, data[:HEADER_BYTES])
    if magic != MAGIC:
        raise FormatError(f"{name}: not a kvd-lm tokenizer (bad magic)")
    if version != VERSION:
        raise FormatError(f"{name}: version {version}, only {VERSION} is known")
    if hbytes != HEADER_BYTES:
        raise FormatError(f"{name}: header bytes {hbytes}, expected {HEADER_BYTES}")
    got = zlib.crc32(data[:HEADER_CRC_SPAN]) & 0xFFFFFFFF
    if got != hcrc:
        raise FormatError(f"{name}: header CRC-32 mismatch (stored {hcrc:08x}, computed {got:08x})")
    if vocab != FIRST_MERGE + merges or vocab > VOCAB_MAX:
        raise FormatError(f"{name}: vocab {vocab} is not {FIRST_MERGE} + merges ({merges}) "
                          f"or is over {VOCAB_MAX}")
    if pbytes != 8 * merges or len(data) != HEADER_BYTES + pbytes:
        raise FormatError(f"{name}: payload of {len(data) - HEADER_BYTES} bytes, expected "
                          f"8 x {merges} merges")
    got = zlib.crc32(data[HEADER_BYTES:]) & 0xFFFFFFFF
    if got != pcrc:
        raise FormatError(f"{name}: payload CRC-32 mismatch (stored {pcrc:08x}, computed {got:08x})")
    pairs = [struct.unpack_from("<2I", data, HEADER_BYTES + 8 * i) for i in range(merges)]
    try:
        return Tokenizer(pairs)
    except FormatError as e:
        raise FormatError(f"{name}: {e}") from None


def load(path):
    with open(path, "rb") as f:
        return parse(f.read(HEADER_BYTES + 8 * VOCAB_MAX + 1), str(path))


def for_model(model_path, vocab):
    """The tokenizer of a model: the .kvdtok file beside it (same name), or BYTES for a
    model of vocab 260 that has none. FormatError when they do not fit."""
    import os
    path = os.path.splitext(model_path)[0] + ".kvdtok"
    if os.path.exists(path):
        tok = load(path)
    elif vocab == FIRST_MERGE:
        return BYTES
    else:
        raise FormatError(f"{model_path}: vocab {vocab} needs a tokenizer file {path}")
    if tok.vocab != vocab:
        raise FormatError(f"{path}: vocab {tok.vocab}, the model's is {vocab}")
    return tok


# --- training --------------------------------------------------------------------------------

def digit_merges():
    """The merges that make every string of 2 and 3 digits one token, as the vocabularies
    of current LLMs have them: first the 100 pairs in numeric order, then for each string
    abc the merge that its cheaper pair leads to, (ab, c) or (a, bc)."""
    d = [ord("0") + i for i in range(10)]
    merges = [(d[a], d[b]) for a in range(10) for b in range(10)]
    pair = lambda a, b: FIRST_MERGE + 10 * a + b
    for a in range(10):
        for b in range(10):
            for c in range(10):
                merges.append((pair(a, b), d[c]) if 10 * a + b <= 10 * b + c else (d[a], pair(b, c)))
    return merges


def train(piece_counts, vocab, first=()):
    """Byte-level BPE over {piece: count}, after the merges `first`: each step merges the
    most frequent adjacent pair (ties: the smallest (left, right) ids), counting every
    piece's occurrences."""
    start = Tokenizer(first)
    words = [list(start.encode_piece(p)) for p in piece_counts]
    freq = list(piece_counts.values())
    pair_count = {}
    where = {}
    for w, (ids, f) in enumerate(zip(words, freq)):
        for k in range(len(ids) - 1):
            pr = (ids[k], ids[k + 1])
            pair_count[pr] = pair_count.get(pr, 0) + f
            where.setdefault(pr, set()).add(w)
    heap = [(-c, pr) for pr, c in pair_count.items()]
    heapq.heapify(heap)
    merges = list(first)
    while FIRST_MERGE + len(merges) < vocab and heap:
        c, pr = heapq.heappop(heap)
        if pair_count.get(pr, 0) != -c:
            continue   # stale entry
        if -c < 2:
            break
        t = FIRST_MERGE + len(merges)
        merges.append(pr)
        changed = set()
        for w in where.pop(pr, ()):
            ids, f = words[w], freq[w]
            for k in range(len(ids) - 1):   # take the word's pairs out ...
                q = (ids[k], ids[k + 1])
                pair_count[q] -= f
                changed.add(q)
            out, k = [], 0
            while k < len(ids):
                if k + 1 < len(ids) and ids[k] == pr[0] and ids[k + 1] == pr[1]:
                    out.append(t)
                    k += 2
                else:
                    out.append(ids[k])
                    k += 1
            words[w] = out
            for k in range(len(out) - 1):   # ... and the new ones in
                q = (out[k], out[k + 1])
                pair_count[q] = pair_count.get(q, 0) + f
                where.setdefault(q, set()).add(w)
                changed.add(q)
        pair_count.pop(pr, None)
        changed.discard(pr)
        for q in changed:
            if pair_count[q] > 0:
                heapq.heappush(heap, (-pair_count[q], q))
    return Tokenizer(merges)


def count_pieces(chunks):
    counts = {}
    for text in chunks:
        for p in pieces(text):
            counts[p] = counts.get(p, 0) + 1
    return counts


def golden_texts(haystack):
    """Texts that exercise every rule of pieces() and the merges: edge cases, then slices
    of the haystack and a task-like text."""
    texts = [b"", b" ", b"  ", b"\n", b"a", b" a", b"1", b" 1", b"12", b"123", b"1234567",
             b"12345678901", b"007 0 00", b"x1y22z333", b"a.b", b" ...", b" (a), b!",
             b"\n\nQuestion: What is it?\nAnswer:", b"tab\there", b"caf\xc3\xa9 \xff\x00 end",
             b"a" * 70, b" " + b"b" * 64, b"-" * 130, b"9" * 10, b" The special magic number "
             b"for xqzpvw is 1234567. VAR ABCDE = 12345.", b"1. word\n2. other  "]
    for at, n in ((0, 300), (5000, 2000), (len(haystack) - 500, 500)):
        texts.append(haystack[at:at + n])
    return texts


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tokenizer.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="print the header and the longest tokens")
    p.add_argument("file")
    p = sub.add_parser("encode", help="print the token ids of a text (no BOS)")
    p.add_argument("file", help="a .kvdtok file, or 'bytes'")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text")
    g.add_argument("--input", help="a file whose bytes are the text")
    p = sub.add_parser("golden", help="print golden records for tests/kvd-lm/test-tokenizer.c")
    p.add_argument("file")
    p.add_argument("haystack")
    p = sub.add_parser("train", help="learn merges from text files")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--corpus", action="append", required=True)
    p.add_argument("--digits", action="store_true",
                   help="start with digit_merges(): every 2- and 3-digit string one token")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "train":
            chunks = [open(c, "rb").read() for c in args.corpus]
            tok = train(count_pieces(chunks), args.vocab, digit_merges() if args.digits else ())
            with open(args.out, "wb") as f:
                f.write(tok.to_bytes())
            print(f"{args.out}: vocab {tok.vocab}, {len(tok.merges)} merges")
            return 0
        tok = BYTES if args.file == "bytes" else load(args.file)
    except (FormatError, OSError) as e:
        print(f"tokenizer.py: {e}", file=sys.stderr)
        return 1
    if args.cmd == "golden":
        out = sys.stdout.buffer
        for text in golden_texts(open(args.haystack, "rb").read()):
            ids = tok.encode(text)
            assert tok.decode(ids) == text
            out.write(b"text %d\n%s\ntokens%s\n\n" % (len(text), text,
                                                    b"".join(b" %d" % t for t in ids)))
        return 0
    if args.cmd == "info":
        print(f"vocab {tok.vocab}, merges {len(tok.merges)}")
        return 0
    text = args.text.encode() if args.text is not None else open(args.input, "rb").read()
    print(" ".join(str(t) for t in tok.encode(text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
