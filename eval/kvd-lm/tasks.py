#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The kvd-lm tasks (eval/kvd-lm/README.md, "Tasks"), byte for byte as tasks.c makes them.

Python 3, standard library only. The training script imports this module; the API below is
stable, and any change to what it generates is a change to tasks.c and to the golden file
tests/data/kvd-lm/tasks-golden.txt (tests/kvd-lm/test-tasks.c compares them).

    import tasks
    hay = tasks.load_haystack()              # bytes; default path: data/haystack.txt here
    prompt, question, answer = tasks.make(hay, "niah", seed, length)
    tokens = [tasks.BOS] + list(prompt)      # len(tokens) == length
    generated = model(tokens)                # the model goes on from the prompt
    ok = tasks.score(prompt, answer, generated)  # the exact-match rule

    TASKS              ("niah", "multikey", "multivalue", "vt", "cwe")
    BOS                256, the token in front of every prompt
    SEEDS_TRAIN        range(0, 2**32)
    SEEDS_TUNE         range(2**32, 2**32 + 2**20)
    SEEDS_REPORT       range(2**40, 2**40 + 2**20), never for training or tuning
    LENGTH_MAX         2**20, the longest prompt in tokens (BOS included)
    GENERATE_MAX       48, the most tokens generated for an answer
    DEFAULT_HAYSTACK   the path of data/haystack.txt next to this file
    load_haystack(path=DEFAULT_HAYSTACK) -> bytes
        The file's text without its final newline; ValueError unless it is non-empty
        printable ASCII of at most 64 MiB.
    min_length(task) -> int
        The smallest length make() accepts for task (it does not depend on the seed).
    make(haystack, task, seed, length) -> (prompt: bytes, question: str, answer: str)
        length counts BOS, so len(prompt) == length - 1; the prompt is printable ASCII
        and '\\n', the context then "\\nQuestion: QUESTION\\nAnswer:", and a space more
        where the answer is a number (niah, multikey, multivalue: a number's space is a
        token of its own). ValueError for an unknown task, a seed outside [0, 2**64) or a
        length outside [min_length(task), LENGTH_MAX].
    context_size(prompt) -> int
        Where the prompt's question tail ("\\nQuestion: ...") starts.
    completion(prompt, answer) -> bytes
        What the model must produce after the prompt: the answer and '\\n', after a
        space unless the prompt ends with one.
    score(prompt, answer, generated) -> bool
        generated (str or bytes) up to its first '\\n', less one leading space unless the
        prompt ends with one, == answer.

As a command, it prints samples:

    python3 tasks.py --task niah --seed 1 --length 1024
    python3 tasks.py --task all --seed 1,2 --length min,4096 --format golden
"""

import argparse
import bisect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tokenizer  # noqa: E402

TASKS = ("niah", "multikey", "multivalue", "vt", "cwe")
BOS = 256
SEEDS_TRAIN = range(0, 1 << 32)
SEEDS_TUNE = range(1 << 32, (1 << 32) + (1 << 20))
SEEDS_REPORT = range(1 << 40, (1 << 40) + (1 << 20))
LENGTH_MAX = 1 << 20
GENERATE_MAX = 48
DEFAULT_HAYSTACK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "haystack.txt")

_HAYSTACK_SIZE_MAX = 64 << 20
_MIN_FILLER = 64
_MIN_CWE_LIST = 128
_NEEDLES = 4
_CWE_WORDS = 30
_CWE_COMMON = 3
_CWE_WEIGHT = 6
_QUESTION_PREFIX = b"\nQuestion: "
_ANSWER_PREFIX = b"\nAnswer:"
# A number's leading space is a token of its own: where the answer is a number, that space
# ends the prompt, so that the prompt's last query predicts the number (README, "Tasks").
_ANSWER_NUMBER_PREFIX = b"\nAnswer: "
_M64 = (1 << 64) - 1


class _Rng:
    """splitmix64, as the README gives it."""

    __slots__ = ("x",)

    def __init__(self, seed):
        self.x = seed

    def below(self, n):
        self.x = (self.x + 0x9E3779B97F4A7C15) & _M64
        z = self.x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return (z ^ (z >> 31)) % n


def load_haystack(path=DEFAULT_HAYSTACK):
    with open(path, "rb") as f:
        text = f.read(_HAYSTACK_SIZE_MAX + 2)
    if text.endswith(b"\n"):
        text = text[:-1]
    if len(text) > _HAYSTACK_SIZE_MAX:
        raise ValueError(f"{path}: larger than 64 MiB")
    if not text:
        raise ValueError(f"{path}: empty")
    if any(b < 0x20 or b > 0x7E for b in text):
        raise ValueError(f"{path}: not printable ASCII")
    return text


def _word(rng, first, n):
    return "".join(chr(first + rng.below(26)) for _ in range(n))


def _distinct_word(rng, first, n, earlier):
    while True:
        w = _word(rng, first, n)
        if w not in earlier:
            return w


def _distinct_number(rng, digits, earlier):
    lo = 10 ** (digits - 1)
    while True:
        v = str(lo + rng.below(9 * lo))
        if v not in earlier:
            return v


# Each planner draws a task's needles (in context order, without their trailing space),
# question and answer; cwe draws its words and list later, in _make_cwe().
def _plan_niah(rng):
    key = _distinct_word(rng, 0x61, 6, ())
    value = _distinct_number(rng, 7, ())
    return ([f" The special magic number for {key} is {value}."],
            f"What is the special magic number for {key}?", value)


def _plan_multikey(rng):
    keys, values = [], []
    for _ in range(_NEEDLES):
        keys.append(_distinct_word(rng, 0x61, 6, keys))
        values.append(_distinct_number(rng, 7, values))
    q = rng.below(_NEEDLES)
    return ([f" The special magic number for {k} is {v}." for k, v in zip(keys, values)],
            f"What is the special magic number for {keys[q]}?", values[q])


def _plan_multivalue(rng):
    key = _distinct_word(rng, 0x61, 6, ())
    values = []
    for _ in range(_NEEDLES):
        values.append(_distinct_number(rng, 7, values))
    return ([f" The special magic number for {key} is {v}." for v in values],
            f"What are all the special magic numbers for {key}?", ", ".join(values))


def _plan_vt(rng):
    value = _distinct_number(rng, 5, ())
    names = []
    for _ in range(_NEEDLES):
        names.append(_distinct_word(rng, 0x41, 5, names))
    rhs = [value] + names[:-1]
    return ([f" VAR {n} = {v}." for n, v in zip(names, rhs)],
            f"Which variables are equal to {value}?", " ".join(names))


def _plan_cwe(rng):
    return ([], "What are the 3 most common words in the list?", None)


_PLANNERS = {
    "niah": _plan_niah,
    "multikey": _plan_multikey,
    "multivalue": _plan_multivalue,
    "vt": _plan_vt,
    "cwe": _plan_cwe,
}


def _suffix(task, question):
    number = task in ("niah", "multikey", "multivalue")
    answer = _ANSWER_NUMBER_PREFIX if number else _ANSWER_PREFIX
    return _QUESTION_PREFIX + question.encode("ascii") + answer


def min_length(task):
    if task not in _PLANNERS:
        raise ValueError(f"unknown task {task!r}")
    # Every needle and question has a fixed size whatever the seed.
    needles, question, _ = _PLANNERS[task](_Rng(0))
    return (1 + len(_suffix(task, question)) + sum(len(n) for n in needles)
            + (_MIN_CWE_LIST if task == "cwe" else _MIN_FILLER))


class _Stream:
    """The haystack as pieces of a tokenizer (tokenizer.pieces): the text is the haystack
    without its trailing spaces, after one space, repeated; a piece never spans a
    repetition, since every space starts one."""

    def __init__(self, haystack, tok):
        unit = b" " + haystack.rstrip(b" ")
        self.pieces = tokenizer.pieces(unit)
        self.starts = [0]      # byte offset of each piece in unit
        self.cum = [0]         # tokens before each piece
        for p in self.pieces:
            self.starts.append(self.starts[-1] + len(p))
            self.cum.append(self.cum[-1] + tok.count(p))
        self.unit = unit
        self.tokens = self.cum[-1]

    def take(self, offset, n):
        """(pieces, tokens): the whole pieces from piece `offset` on, wrapping around,
        that fit in n tokens, and how many tokens they hold."""
        out, got, at = [], 0, offset
        if self.tokens - self.cum[at] <= n:     # the rest of the text, then whole repeats
            out += self.pieces[at:]
            got, at = self.tokens - self.cum[at], 0
            reps = (n - got) // self.tokens
            out += self.pieces * reps
            got += reps * self.tokens
        end = bisect.bisect_right(self.cum, self.cum[at] + n - got, at) - 1
        out += self.pieces[at:end]
        return out, got + self.cum[end] - self.cum[at]


_streams = {}


def _stream(haystack, tok):
    key = (id(tok), hash(haystack), len(haystack))
    s = _streams.get(key)
    if s is None:
        if len(_streams) > 8:
            _streams.clear()
        s = _streams[key] = _Stream(haystack, tok)
    return s


def _make_needles(haystack, tok, rng, offset, needles, size):
    n_filler = size - sum(tok.count(n.encode("ascii")) for n in needles)
    depths = sorted(rng.below(101) for _ in needles)
    filler, got = _stream(haystack, tok).take(offset, n_filler)
    filler += [b" "] * (n_filler - got)
    # where each piece starts, in tokens
    at_token, t = [], 0
    for p in filler:
        at_token.append(t)
        t += tok.count(p)
    parts, prev = [], 0
    for needle, d in zip(needles, depths):
        k = bisect.bisect_left(at_token, n_filler * d // 100, prev)
        while k < len(filler) and filler[k][:1] != b" ":
            k += 1
        parts += filler[prev:k] + [needle.encode("ascii")]
        prev = k
    parts += filler[prev:]
    return b"".join(parts)


def _make_cwe(tok, rng, size):
    words = []
    for _ in range(_CWE_WORDS):
        words.append(_distinct_word(rng, 0x61, 4 + rng.below(5), words))
    n_common = _CWE_COMMON * _CWE_WEIGHT
    count, first, items, o = [0] * _CWE_WORDS, [0] * _CWE_WORDS, [], 0
    while True:
        x = rng.below(n_common + _CWE_WORDS - _CWE_COMMON)
        w = x // _CWE_WEIGHT if x < n_common else x - (n_common - _CWE_COMMON)
        item = f"{chr(10) if items else ''}{len(items) + 1}. {words[w]}"
        n = tok.count(item.encode("ascii"))
        if o + n > size:
            break
        if count[w] == 0:
            first[w] = len(items)
        count[w] += 1
        items.append(item)
        o += n
    top = sorted((w for w in range(_CWE_WORDS) if count[w]), key=lambda w: (-count[w], first[w]))
    context = "".join(items) + " " * (size - o)
    return context.encode("ascii"), " ".join(words[w] for w in top[:_CWE_COMMON])


def make(haystack, task, seed, length, tok=tokenizer.BYTES):
    if task not in _PLANNERS:
        raise ValueError(f"unknown task {task!r}")
    if not 0 <= seed <= _M64:
        raise ValueError(f"seed {seed} is not a 64-bit unsigned integer")
    if not min_length(task) <= length <= LENGTH_MAX:
        raise ValueError(f"{task}: length {length} outside [{min_length(task)}, {LENGTH_MAX}]")
    if not haystack:
        raise ValueError("empty haystack")
    rng = _Rng(seed)
    offset = rng.below(len(_stream(haystack, tok).pieces)) if task != "cwe" else 0
    needles, question, answer = _PLANNERS[task](rng)
    suffix = _suffix(task, question)
    size = length - 1 - tok.count(suffix)
    if task == "cwe":
        context, answer = _make_cwe(tok, rng, size)
    else:
        context = _make_needles(haystack, tok, rng, offset, needles, size)
    return context + suffix, question, answer


def context_size(prompt):
    return prompt.rindex(_QUESTION_PREFIX)


def completion(prompt, answer):
    return (b"" if prompt.endswith(b" ") else b" ") + answer.encode("ascii") + b"\n"


def score(prompt, answer, generated):
    if isinstance(generated, (bytes, bytearray)):
        generated = generated.decode("latin-1")
    line = generated.split("\n", 1)[0]
    if line.startswith(" ") and not prompt.endswith(b" "):
        line = line[1:]
    return line == answer


def golden_record(task, seed, length, tok_name, prompt, question, answer):
    """One record of the golden file, as test-tasks.c prints it too."""
    return (f"task {task} seed {seed} length {length} tokenizer {tok_name}\n"
            f"prompt {len(prompt)}\n".encode("ascii")
            + prompt + f"\nquestion {question}\nanswer {answer}\n\n".encode("ascii"))


def main():
    ap = argparse.ArgumentParser(description="Print kvd-lm task samples.")
    ap.add_argument("--task", default="niah", help="comma-separated tasks, or 'all'")
    ap.add_argument("--seed", default="1", help="comma-separated seeds (0x... allowed)")
    ap.add_argument("--length", default="1024",
                    help="comma-separated lengths in tokens, BOS included; 'min' is the task's least")
    ap.add_argument("--format", choices=("text", "golden"), default="text")
    ap.add_argument("--haystack", default=DEFAULT_HAYSTACK)
    ap.add_argument("--tokenizer", default="bytes",
                    help="a .kvdtok file whose tokens size the prompts, or 'bytes'")
    args = ap.parse_args()

    task_list = TASKS if args.task == "all" else args.task.split(",")
    for t in task_list:
        if t not in TASKS:
            ap.error(f"unknown task {t!r}; one of {', '.join(TASKS)}")
    try:
        seeds = [int(s, 0) for s in args.seed.split(",")]
        lengths = [None if x == "min" else int(x, 0) for x in args.length.split(",")]
    except ValueError as e:
        ap.error(str(e))

    haystack = load_haystack(args.haystack)
    if args.tokenizer == "bytes":
        tok, tok_name = tokenizer.BYTES, "bytes"
    else:
        try:
            tok = tokenizer.load(args.tokenizer)
        except (OSError, tokenizer.FormatError) as e:
            sys.exit(f"tasks.py: {e}")
        tok_name = os.path.splitext(os.path.basename(args.tokenizer))[0]
    out = sys.stdout.buffer
    for t in task_list:
        for seed in seeds:
            for length in lengths:
                length = min_length(t) if length is None else length
                try:
                    prompt, question, answer = make(haystack, t, seed, length, tok)
                except ValueError as e:
                    sys.exit(f"tasks.py: {e}")
                if args.format == "golden":
                    out.write(golden_record(t, seed, length, tok_name, prompt, question, answer))
                else:
                    out.write(f"== {t} seed {seed} length {length}\n".encode("ascii") + prompt
                              + f" {answer}\n\n".encode("ascii"))


if __name__ == "__main__":
    main()
