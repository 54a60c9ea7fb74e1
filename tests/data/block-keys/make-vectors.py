#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""
Test vectors of the content keys (docs/engines.md, "Prefix sharing"), from a Python
implementation of vLLM's definition: sha256_cbor(x) = SHA-256 of cbor2.dumps(x,
canonical=True); a block's key is sha256_cbor((parent, tuple(token_ids), extra_keys)), the
first block's parent is sha256_cbor(seed) (vLLM's NONE_HASH with PYTHONHASHSEED=seed), and
extra_keys is None or a tuple (the cache salt only on the first block).

  make-vectors.py > vectors.txt      writes them
  make-vectors.py --check FILE       exits 1 when FILE is not what this computes

Line formats (hex keys; token lists comma-separated, '-' for none):
  root SEED KEY
  block PARENT TOKENS EXTRAS KEY      EXTRAS: '-' (None) or items 's:TEXT' / 'i:INT' joined by '|'
  prefix SEED BLOCK_TOKENS SALT TOKENS KEY...   SALT: '-' for none
"""
import hashlib
import random
import sys

import cbor2


def sha256_cbor(x):
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


def block_key(parent, tokens, extra):
    return sha256_cbor((parent, tuple(tokens), extra))


def prefix_keys(root, tokens, block_tokens, salt):
    keys, parent = [], root
    for b in range(len(tokens) // block_tokens):
        extra = (salt,) if b == 0 and salt is not None else None
        parent = block_key(parent, tokens[b * block_tokens:(b + 1) * block_tokens], extra)
        keys.append(parent)
    return keys


def csv(tokens):
    return ','.join(map(str, tokens)) if tokens else '-'


def vectors():
    rng = random.Random(7)
    out = []
    for seed in ['0', '42', 'kvd-fleet', '']:
        out.append(f'root {seed or "-"} {sha256_cbor(seed).hex()}')
    root = sha256_cbor('0')
    # Token ids across every CBOR integer width, block sizes around the array header's
    # widths (23, 24, 255, 256), and extra keys of both kinds.
    cases = [
        ([], None), ([0], None), ([23, 24, 255, 256, 65535, 65536, 2**32 - 1], None),
        (list(range(16)), ('salt',)), (list(range(16)), (7,)), (list(range(16)), (-1, -25, -300)),
        (list(range(16)), ('lora-a', 3, 'mm:' + 'ab' * 32)),
        ([rng.randrange(152064) for _ in range(23)], None),
        ([rng.randrange(152064) for _ in range(24)], None),
        ([rng.randrange(152064) for _ in range(256)], ('x' * 30,)),
    ]
    for tokens, extra in cases:
        ex = '-' if extra is None else '|'.join(
            ('s:' + e) if isinstance(e, str) else f'i:{e}' for e in extra)
        out.append(f'block {root.hex()} {csv(tokens)} {ex} {block_key(root, tokens, extra).hex()}')
    for seed, bt, salt, n in [('0', 16, None, 100), ('42', 16, 'tenant-salt', 64), ('kvd-fleet', 4, None, 9)]:
        tokens = [rng.randrange(32000) for _ in range(n)]
        keys = prefix_keys(sha256_cbor(seed), tokens, bt, salt)
        out.append(f'prefix {seed} {bt} {salt or "-"} {csv(tokens)} ' + ' '.join(k.hex() for k in keys))
    return '\n'.join(out) + '\n'


if __name__ == '__main__':
    if len(sys.argv) == 3 and sys.argv[1] == '--check':
        with open(sys.argv[2]) as f:
            if f.read() != vectors():
                print(f'{sys.argv[2]} is not what the reference computes: regenerate it')
                sys.exit(1)
        print('the vectors match the reference implementation')
    else:
        sys.stdout.write(vectors())
